"""The reassembly loops of `reassembly`, compiled by numba: one pass per segment where
numpy makes six, with the GIL released so frames decode in parallel on threads.

Imported only when numba is installed (`pip install shardprep[fast]`). The signatures are
explicit, so everything compiles once, on import (about a second per loop; `cache=True`
keeps the machine code on disk for the next process), and never again halfway through a
file: inputs are read-only C arrays (writable ones convert), outputs may be unaligned.
The callers check every size first: these loops do not check bounds.
"""

from __future__ import annotations

import numba
from numba import types

_U8_IN = types.Array(types.uint8, 1, "C", readonly=True)
_U16_OUT = types.Array(types.uint16, 1, "C", aligned=False)
_U32_OUT = types.Array(types.uint32, 1, "C", aligned=False)
_JIT = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}


@numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, types.int64), **_JIT)
def join_bf16(out, sym, packed, base):  # type: ignore[no-untyped-def]
    """`reassembly.join_bf16` (out.size % 32 == 0, sym.size == out.size,
    packed.size == out.size // 4 * 3)."""
    quarter = out.size // 4
    head = 3 * quarter
    offset = base << 7
    for i in range(head):
        rem = packed[i]
        out[i] = ((sym[i] << 5) + offset) | ((rem & 0x80) << 8) | (rem & 0x1F)
    for j in range(quarter):
        a, b, c = packed[j], packed[quarter + j], packed[2 * quarter + j]
        rem = ((a >> 5) & 0x03) | ((b >> 3) & 0x0C) | ((c >> 1) & 0x10) | ((c << 1) & 0x80)
        out[head + j] = ((sym[head + j] << 5) + offset) | ((rem & 0x80) << 8) | (rem & 0x1F)


@numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN), **_JIT)
def join_f16(out, sym, rem):  # type: ignore[no-untyped-def]
    """`reassembly.join_f16` (all three the same size)."""
    for i in range(out.size):
        out[i] = (sym[i] << 7) | ((rem[i] & 0x80) << 8) | (rem[i] & 0x7F)


@numba.njit(types.void(_U32_OUT, _U8_IN, _U8_IN, types.int64, _U8_IN, _U8_IN), **_JIT)
def join_f32(out, sym, packed, base, byte1, byte0):  # type: ignore[no-untyped-def]
    """`reassembly.join_f32`: the high halves as `join_bf16`, the low ones as they are."""
    quarter = out.size // 4
    head = 3 * quarter
    offset = base << 7
    for i in range(head):
        rem = packed[i]
        high = ((sym[i] << 5) + offset) | ((rem & 0x80) << 8) | (rem & 0x1F)
        out[i] = (high << 16) | (byte1[i] << 8) | byte0[i]
    for j in range(quarter):
        a, b, c = packed[j], packed[quarter + j], packed[2 * quarter + j]
        rem = ((a >> 5) & 0x03) | ((b >> 3) & 0x0C) | ((c >> 1) & 0x10) | ((c << 1) & 0x80)
        i = head + j
        high = ((sym[i] << 5) + offset) | ((rem & 0x80) << 8) | (rem & 0x1F)
        out[i] = (high << 16) | (byte1[i] << 8) | byte0[i]
