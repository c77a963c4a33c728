"""Encoders of the codec's earlier segment layouts, which files written before still hold:
patched into `transforms.ENCODERS` to write such files, so that tests can decode them."""

from __future__ import annotations

import numpy as np
import torch

from shardprep.codec import stored, transforms


def encode_f16_as_before(data: memoryview, item: int) -> transforms.Encoded:
    """The earlier F16 layout: symbol = exponent and top 3 mantissa bits, remainder byte =
    sign and the low 7."""
    words = np.frombuffer(data, "<u2")
    sym = ((words >> 7) & 0xFF).astype(np.uint8)
    rem = (((words >> 8) & 0x80) | (words & 0x7F)).astype(np.uint8)
    return stored.F16, stored.F16_BYTE, [sym, rem], False


def encode_bf16_as_before(data: memoryview, item: int) -> transforms.Encoded:
    """The earlier BF16 kind: 8-bit symbols (exponent and top 2 mantissa bits), as F32's
    high halves still are."""
    words = np.frombuffer(data, "<u2")
    base = transforms._pick_base(words)
    assert base is not None
    return stored.BF16, base, list(transforms._split_bf16(words, base, top=2)), False


# layout -> (dtype, the kind its encoder replaces, the earlier encoder)
EARLIER_LAYOUTS = {
    "f16": (torch.float16, stored.F16, encode_f16_as_before),
    "bf16": (torch.bfloat16, stored.BF16_7, encode_bf16_as_before),
}
