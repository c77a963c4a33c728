"""The reassembly loops of `reassembly`, compiled by numba: one pass per segment where
numpy makes six, with the GIL released so frames decode in parallel on threads.

Imported only when numba is installed (`pip install shardprep[fast]`). The signatures are
explicit, so everything compiles once, on import (about a second per loop; `cache=True`
keeps the machine code on disk for the next process), and never again halfway through a
file: inputs are read-only C arrays (writable ones convert), outputs may be unaligned.
The callers check every size first: these loops do not check bounds.

The arithmetic is done in u32 (`_W`): numba widens u8 and u16 operands to int64, which
LLVM vectorises four lanes at a time; in u32 it takes eight or sixteen, and a join runs
about four times faster (2 Mi bf16 elements in cache: 0.12 ms against 0.48 ms here).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types

_U8_IN = types.Array(types.uint8, 1, "C", readonly=True)
_U16_OUT = types.Array(types.uint16, 1, "C", aligned=False)
_U32_OUT = types.Array(types.uint32, 1, "C", aligned=False)
_JIT = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}
_W = np.uint32


@numba.njit(types.uint32(types.uint32, types.uint32, types.uint32), inline="always", **_JIT)
def _high(sym, rem, offset):  # type: ignore[no-untyped-def]
    """A bf16 word from its symbol and its remainder byte 's00mmmmm'."""
    return ((sym << _W(5)) + offset) | ((rem & _W(0x80)) << _W(8)) | (rem & _W(0x1F))


@numba.njit(types.uint32(types.uint32, types.uint32, types.uint32), inline="always", **_JIT)
def _tail_rem(a, b, c):  # type: ignore[no-untyped-def]
    """The remainder byte of a tail element, from bits 5-6 of its three carriers."""
    return (
        ((a >> _W(5)) & _W(0x03))
        | ((b >> _W(3)) & _W(0x0C))
        | ((c >> _W(1)) & _W(0x10))
        | ((c << _W(1)) & _W(0x80))
    )


@numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, types.int64), **_JIT)
def join_bf16(out, sym, packed, base):  # type: ignore[no-untyped-def]
    """`reassembly.join_bf16` (out.size % 32 == 0, sym.size == out.size,
    packed.size == out.size // 4 * 3)."""
    quarter = out.size // 4
    head = 3 * quarter
    offset = _W(base << 7)
    for i in range(head):
        out[i] = _high(_W(sym[i]), _W(packed[i]), offset)
    for j in range(quarter):
        rem = _tail_rem(_W(packed[j]), _W(packed[quarter + j]), _W(packed[2 * quarter + j]))
        out[head + j] = _high(_W(sym[head + j]), rem, offset)


@numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN), **_JIT)
def join_f16(out, sym, rem):  # type: ignore[no-untyped-def]
    """`reassembly.join_f16` (all three the same size)."""
    for i in range(out.size):
        r = _W(rem[i])
        out[i] = (_W(sym[i]) << _W(7)) | ((r & _W(0x80)) << _W(8)) | (r & _W(0x7F))


@numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, _U8_IN), **_JIT)
def join_f16_signs(out, sym, low, signs):  # type: ignore[no-untyped-def]
    """`reassembly.join_f16_signs` (sym.size == low.size == out.size == 8 * signs.size)."""
    eighth = signs.size
    for k in range(8):
        shift = _W(k)
        for j in range(eighth):
            i = k * eighth + j
            sign = ((_W(signs[j]) >> shift) & _W(1)) << _W(15)
            out[i] = sign | (_W(sym[i]) << _W(8)) | _W(low[i])


@numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, types.int64), **_JIT)
def join_bf16_7(out, sym, packed, base):  # type: ignore[no-untyped-def]
    """`reassembly.join_bf16_7` (out.size % 32 == 0, sym.size == out.size,
    packed.size == out.size // 8 * 7)."""
    eighth = out.size // 8
    head = 7 * eighth
    offset = _W(base << 7)
    for i in range(head):
        rem = _W(packed[i])
        out[i] = ((_W(sym[i]) << _W(6)) + offset) | ((rem & _W(0x80)) << _W(8)) | (rem & _W(0x3F))
    # Slices, not offsets into `packed`: LLVM vectorises the loop only then (9x faster).
    c0, c1, c2 = packed[:eighth], packed[eighth : 2 * eighth], packed[2 * eighth : 3 * eighth]
    c3, c4 = packed[3 * eighth : 4 * eighth], packed[4 * eighth : 5 * eighth]
    c5, c6 = packed[5 * eighth : 6 * eighth], packed[6 * eighth : 7 * eighth]
    dest, syms = out[head:], sym[head:]
    for j in range(eighth):
        low = (
            ((_W(c0[j]) >> _W(6)) & _W(0x01))
            | ((_W(c1[j]) >> _W(5)) & _W(0x02))
            | ((_W(c2[j]) >> _W(4)) & _W(0x04))
            | ((_W(c3[j]) >> _W(3)) & _W(0x08))
            | ((_W(c4[j]) >> _W(2)) & _W(0x10))
            | ((_W(c5[j]) >> _W(1)) & _W(0x20))
            | ((_W(c6[j]) << _W(9)) & _W(0x8000))
        )
        dest[j] = ((_W(syms[j]) << _W(6)) + offset) | low


@numba.njit(types.void(_U32_OUT, _U8_IN, _U8_IN, types.int64, _U8_IN, _U8_IN), **_JIT)
def join_f32(out, sym, packed, base, byte1, byte0):  # type: ignore[no-untyped-def]
    """`reassembly.join_f32`: the high halves as `join_bf16`, the low ones as they are."""
    quarter = out.size // 4
    head = 3 * quarter
    offset = _W(base << 7)
    for i in range(head):
        high = _high(_W(sym[i]), _W(packed[i]), offset)
        out[i] = (high << _W(16)) | (_W(byte1[i]) << _W(8)) | _W(byte0[i])
    for j in range(quarter):
        i = head + j
        rem = _tail_rem(_W(packed[j]), _W(packed[quarter + j]), _W(packed[2 * quarter + j]))
        high = _high(_W(sym[i]), rem, offset)
        out[i] = (high << _W(16)) | (_W(byte1[i]) << _W(8)) | _W(byte0[i])
