"""convert/dequantize.py computes what vLLM's `scaled_dequantize` computes (the weights
vLLM dequantizes while loading, e.g. DeepSeek-V3.2's fp8 indexer `wk`), bit for bit: block
scales over 2-D blocks, one scale per row, one for the whole weight."""

from __future__ import annotations

import pytest
import torch

from shardprep.convert.dequantize import dequantize

quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")


@pytest.mark.parametrize(
    ("weight_shape", "scale_shape"),
    [((256, 384), (2, 3)), ((128, 7168), (1, 56)), ((64, 96), (64,)), ((32, 32), (1, 1))],
    ids=["blocks", "v32-wk", "per-row", "one-scale"],
)
def test_dequantize_is_vllms_scaled_dequantize(
    weight_shape: tuple[int, int], scale_shape: tuple[int, ...]
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(weight_shape, generator=generator).clamp(-4, 4).to(torch.float8_e4m3fn)
    scale = 0.01 + 0.02 * torch.rand(scale_shape, generator=generator)
    if scale.dim() == 1:  # as `_try_load_fp8_indexer_wk` builds it: one group per row
        group = quant_utils.GroupShape(1, weight.shape[1])
    else:
        group = quant_utils.GroupShape(
            weight.shape[0] // scale.shape[0], weight.shape[1] // scale.shape[1]
        )
    expected = quant_utils.scaled_dequantize(
        weight, scale, group_shape=group, out_dtype=torch.bfloat16
    )
    ours = dequantize(torch, weight, scale)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))


def test_power_of_two_scales_are_decoded_first_as_vllm_does() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn((256, 384), generator=generator).clamp(-4, 4).to(torch.float8_e4m3fn)
    scale = torch.randint(120, 130, (2, 3), generator=generator, dtype=torch.uint8)  # E8M0
    decoded = scale.view(torch.float8_e8m0fnu).to(torch.float32)  # `_try_load_fp8_indexer_wk`
    expected = quant_utils.scaled_dequantize(
        weight, decoded, group_shape=quant_utils.GroupShape(128, 128), out_dtype=torch.bfloat16
    )
    assert torch.equal(
        dequantize(torch, weight, scale).view(torch.int16), expected.view(torch.int16)
    )
