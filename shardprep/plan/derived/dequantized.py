"""Runs in the deriving child, beside probe.py: a weight vLLM's `load_weights` dequantizes
before copying it into a layer it builds unquantized (DeepSeek-V3.2's and GLM-5's indexer
`wk`, stored fp8 with block scales, fused into a bfloat16 parameter), recognized by the ops
vLLM's `scaled_dequantize` makes of it: the whole fp8 weight cast to float32, times its
scales broadcast over their blocks (only reshaped and cast on the way), then cast to
bfloat16. Such a value is a copy of a tensor convert computes the same way
(convert/dequantize.py): the weight's name + DEQUANTIZED, of the weight's shape."""

from __future__ import annotations

from typing import Any

from shardprep.plan.archs.base import DEQUANTIZED

FP8 = ("torch.float8_e4m3fn", "torch.float8_e5m2")
# The ops a scale goes through on its way to the product: views and copies of its values.
RESHAPED = {"cast", "clone", "contiguous", "_unsafe_view", "view", "reshape", "expand"}
COMPUTED = "BF16"  # what convert computes


def scale_over_blocks(weight: tuple[int, ...], scale: tuple[int, ...]) -> bool:
    """Whether `scale` has one value per block of a grid over `weight` (or one per row)."""
    if len(weight) != 2:
        return False
    if len(scale) == 1:
        return scale[0] == weight[0]
    return len(scale) == 2 and all(s > 0 and w % s == 0 for w, s in zip(weight, scale, strict=True))


def dequantized_name(
    weight: tuple[str, Any, Any],
    scale: tuple[str, tuple[str, ...], Any],
    out: Any,
) -> str | None:
    """The name of the value `out` holds where it is a weight times its scales over their
    blocks: `weight` (its placeholder's name, the placeholder, the whole copy's numel) and
    `scale` (its placeholder's name, the ops from it, the placeholder); None otherwise."""
    name, placeholder, numel = weight
    scale_name, ops, scale_placeholder = scale
    if str(placeholder.dtype) not in FP8 or numel != placeholder.numel():
        return None
    if tuple(out.shape) != tuple(placeholder.shape) or not set(ops) <= RESHAPED:
        return None
    if not scale_over_blocks(tuple(placeholder.shape), tuple(scale_placeholder.shape)):
        return None
    return name + DEQUANTIZED if scale_name != name else None
