"""The placeholders vLLM's `load_weights` is fed while deriving: each checkpoint tensor's
name and shape, in the serving dtype where the checkpoint holds it in a floating-point
dtype a model is built in, in its own dtype otherwise (uint8 packed blocks and scales,
int32 packs, fp8 values, e8m0 scales). A floating-point tensor's dtype does not change
where vLLM copies it; a quantized one's does: vLLM's loaders pick their path by it (an
MXFP4 scale in uint8 is copied, one in a floating-point dtype is encoded first)."""

from __future__ import annotations

from collections.abc import Mapping

from shardprep.format.dtypes import FLOAT_DTYPES

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)


def placeholders(
    shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], serving: str
) -> Tensors:
    """{name: (dtype, shape)} for `shapes`, `dtypes` being the checkpoint's (empty: not
    known, every placeholder in `serving`, the model's dtype as vLLM builds it)."""
    return {name: (_dtype(dtypes.get(name), serving), tuple(s)) for name, s in shapes.items()}


def _dtype(stored: str | None, serving: str) -> str:
    return serving if stored is None or stored in FLOAT_DTYPES else stored
