"""Weights that vLLM dequantizes while loading, computed as vLLM computes them.

Some layers are built without quantization although the checkpoint stores their weight
quantized: DeepSeek-V3.2's indexer fuses an fp8 `wk` (with block scales) and a bfloat16
`weights_proj` into one bfloat16 parameter, and vLLM's `load_weights` dequantizes `wk`
first (`_try_load_fp8_indexer_wk`: `scaled_dequantize`, the weight and its scales in
float32, multiplied, rounded to bfloat16). The family names such weights
(`Family.dequantized_sources`); here each is computed once, from the bytes of the weight
and of its scales (read by offset, or by range request from the Hub), and held in memory
as a tensor of the checkpoint under its own name (they are small: 1.8 MB a layer for
DeepSeek-V3.2). The plan reads it like any other source tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardprep.convert.checkpoint import Checkpoint, SourceTensor
from shardprep.errors import ConfigError, CorruptFileError
from shardprep.format.dtypes import safetensors_name, torch_dtype
from shardprep.format.headers import TensorInfo
from shardprep.plan import archs


def with_dequantized(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint plus the tensors its family says vLLM dequantizes while loading."""
    try:
        family = archs.target_family(checkpoint.config)[1]
    except ConfigError:
        return checkpoint  # planning says what is wrong with it
    dtypes = {name: t.info.dtype for name, t in checkpoint.tensors.items()}
    shapes = {name: t.info.shape for name, t in checkpoint.tensors.items()}
    wanted = family.dequantized_sources(checkpoint.config, dtypes, shapes)
    if not wanted:
        return checkpoint
    import torch

    tensors, side = dict(checkpoint.tensors), dict(checkpoint.side_tensors)
    for name, (weight, scale) in sorted(wanted.items()):
        values = dequantize(
            torch, _read(torch, checkpoint, weight), _read(torch, checkpoint, scale)
        )
        data = values.contiguous().view(torch.uint8).numpy().tobytes()
        info = TensorInfo(safetensors_name(values.dtype), tuple(values.shape), 0, len(data))
        tensors[name] = SourceTensor(name, "", info)  # no file: its bytes are `side`'s
        side[name] = data
    return dataclasses.replace(checkpoint, tensors=tensors, side_tensors=side)


def dequantize(torch: Any, weight: Any, scale: Any) -> Any:
    """vLLM's `scaled_dequantize` of a 2-D weight with 2-D block scales (or one scale per
    row): each block's scale over its block, the product in float32, then bfloat16."""
    if scale.dtype == torch.uint8:  # power-of-two (E8M0) scales of MXFP8, as vLLM reads them
        scale = scale.view(torch.float8_e8m0fnu)
    scale = scale.to(torch.float32)
    if scale.dim() == 1:
        scale = scale[:, None]
    rows, cols = weight.shape[0] // scale.shape[0], weight.shape[1] // scale.shape[1]
    scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return (weight.to(torch.float32) * scale).to(torch.bfloat16)


def _read(torch: Any, checkpoint: Checkpoint, name: str) -> Any:
    tensor = checkpoint.tensors[name]
    info = tensor.info
    data = checkpoint.read(tensor.file, info.offset, info.nbytes)
    if len(data) != info.nbytes:
        raise CorruptFileError(
            f"{checkpoint.root / tensor.file} ends inside {name}; the file is damaged or "
            "was changed since: download the model again",
            path=str(checkpoint.root / tensor.file),
        )
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(torch_dtype(torch, info.dtype)).view(info.shape)
