"""The reassembly loops of `reassembly`, compiled by numba: one pass per segment where
numpy makes six, with the GIL released so frames decode in parallel on threads; and, with
the system's libzstd, a whole frame decoded in one call (`decode_frame`).

Imported only when numba is installed (`pip install shardprep[fast]`). The signatures are
explicit, so everything compiles once, on import (about 10 s in all; `cache=True` keeps the
machine code on disk for the next process, which loads it in under half a second), and
never again halfway through a file: inputs are read-only C arrays (writable ones convert),
outputs may be unaligned. The callers check every size first: these loops do not check
bounds.

The arithmetic is done in u32 (`_W`): numba widens u8 and u16 operands to int64, which
LLVM vectorises four lanes at a time; in u32 it takes eight or sixteen, and a join runs
about four times faster (2 Mi bf16 elements in cache: 0.12 ms against 0.48 ms here).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from shardprep.codec import libzstd
from shardprep.codec import transforms as tf

if TYPE_CHECKING:
    from shardprep.codec.container import Frame

_U8 = types.Array(types.uint8, 1, "C")
_U8_IN = types.Array(types.uint8, 1, "C", readonly=True)
_U16_OUT = types.Array(types.uint16, 1, "C", aligned=False)
_U32_OUT = types.Array(types.uint32, 1, "C", aligned=False)
_TABLE = types.Array(types.int64, 2, "C")
_INNER = {"nogil": True, "boundscheck": False, "error_model": "numpy"}  # inside `_decode`
_JIT = {**_INNER, "cache": True}
_W = np.uint32
_KEEP_AT_MOST = 64 * 1024**2  # scratch bytes a thread keeps between frames


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


def bf16_loop(out, sym, packed, base):  # type: ignore[no-untyped-def]
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


def f16_loop(out, sym, rem):  # type: ignore[no-untyped-def]
    """`reassembly.join_f16` (all three the same size)."""
    for i in range(out.size):
        r = _W(rem[i])
        out[i] = (_W(sym[i]) << _W(7)) | ((r & _W(0x80)) << _W(8)) | (r & _W(0x7F))


def f16_signs_loop(out, sym, low, signs):  # type: ignore[no-untyped-def]
    """`reassembly.join_f16_signs` (sym.size == low.size == out.size == 8 * signs.size)."""
    eighth = signs.size
    for k in range(8):
        shift = _W(k)
        for j in range(eighth):
            i = k * eighth + j
            sign = ((_W(signs[j]) >> shift) & _W(1)) << _W(15)
            out[i] = sign | (_W(sym[i]) << _W(8)) | _W(low[i])


def bf16_7_loop(out, sym, packed, base):  # type: ignore[no-untyped-def]
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


def f32_loop(out, sym, packed, base, byte1, byte0):  # type: ignore[no-untyped-def]
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


# Called from Python with the caller's arrays (readonly inputs, outputs maybe unaligned);
# `_decode` below compiles the same loops again for the arrays it makes itself.
join_bf16 = numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, types.int64), **_JIT)(bf16_loop)
join_f16 = numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN), **_JIT)(f16_loop)
join_f16_signs = numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, _U8_IN), **_JIT)(f16_signs_loop)
join_bf16_7 = numba.njit(types.void(_U16_OUT, _U8_IN, _U8_IN, types.int64), **_JIT)(bf16_7_loop)
join_f32 = numba.njit(types.void(_U32_OUT, _U8_IN, _U8_IN, types.int64, _U8_IN, _U8_IN), **_JIT)(
    f32_loop
)


# ---------------------------------------------------------------------------- whole frames
#
# A whole frame in one call, without the GIL: each zstd stream decoded by the system's
# libzstd (`libzstd`, called by address) into scratch memory the thread reuses, each
# segment joined as soon as its planes are decoded, while they are in the core's cache.
# Against the frame decoded stream by stream (`container`: zstandard's bytes objects, then
# these joins, with Python in between), MiniLM in bf16 took 8.8-9.8 ms instead of
# 11.6-12.5 on two threads, 17.3-18.8 instead of 20.9-22.9 on one: less time waiting for
# the GIL, less in zstd (docs/benchmarks-history.md).
# `container` has checked every size in the frame's tables first, and libzstd writes at
# most the capacity it is given. A stream that does not decode to its size, or an escape
# outside its segment, makes `decode_frame` return False: the caller then decodes the frame
# through `transforms`, which says what is wrong. Kept in this file: numba's cache is
# invalidated when the file of a cached function changes, not when its callees' does.

_bf16 = numba.njit(**_INNER)(bf16_loop)
_bf16_7 = numba.njit(**_INNER)(bf16_7_loop)
_f16 = numba.njit(**_INNER)(f16_loop)
_f16_signs = numba.njit(**_INNER)(f16_signs_loop)
_f32 = numba.njit(**_INNER)(f32_loop)


@intrinsic
def _call(typingctx, fn, dctx, dst, capacity, src, size):  # type: ignore[no-untyped-def]
    """fn(dctx, dst, capacity, src, size), `fn` the address of a C function of five 64-bit
    integers that returns one (an argument, not a constant, so the code can be cached)."""
    args = (fn, dctx, dst, capacity, src, size)
    if not all(isinstance(a, types.Integer) and a.bitwidth == 64 for a in args):
        return None
    i64 = ir.IntType(64)

    def codegen(context, builder, signature, values):  # type: ignore[no-untyped-def]
        pointer = builder.inttoptr(values[0], ir.FunctionType(i64, [i64] * 5).as_pointer())
        return builder.call(pointer, values[1:])

    return types.uint64(*args), codegen


# `src` = (fn, dctx, payload, streams, offsets): libzstd's ZSTD_decompressDCtx and the
# thread's context, the frame's stream bytes, its stream table (method, raw size, stored
# size) and where each stream starts in the payload.


@numba.njit(**_INNER)
def _decode_into(src, i, dest):  # type: ignore[no-untyped-def]
    """Whether zstd stream i decodes to exactly dest.size bytes, into `dest`."""
    fn, dctx, payload, streams, offsets = src
    source = payload[offsets[i] : offsets[i] + streams[i, 2]]
    written = _call(fn, dctx, dest.ctypes.data, dest.size, source.ctypes.data, source.size)
    return written == dest.size


@numba.njit(**_INNER)
def _plane(src, i, scratch, at):  # type: ignore[no-untyped-def]
    """(ok, stream i's bytes): a raw stream in place, a zstd one decoded into scratch[at:]."""
    _, _, payload, streams, offsets = src
    if streams[i, 0] == tf.RAW:
        return True, payload[offsets[i] : offsets[i] + streams[i, 1]]
    dest = scratch[at : at + streams[i, 1]]
    return _decode_into(src, i, dest), dest


@numba.njit(**_INNER)
def _patch(words, escapes, shift):  # type: ignore[no-untyped-def]
    """`transforms._patch_escapes` on u16 words (shift 0) or on the high halves of u32
    words (shift 16); False if an escape points outside the segment."""
    count = escapes.size // 5
    keep = (np.uint32(0x807F) << np.uint32(shift)) | np.uint32((1 << shift) - 1)
    for k in range(count):
        where = np.int64(escapes[4 * k]) | np.int64(escapes[4 * k + 1]) << 8
        where |= np.int64(escapes[4 * k + 2]) << 16 | np.int64(escapes[4 * k + 3]) << 24
        if where >= words.size:
            return False
        exponent = np.uint32(escapes[4 * count + k]) << np.uint32(7 + shift)
        words[where] = (np.uint32(words[where]) & keep) | exponent
    return True


@numba.njit(**_INNER)
def _planes(src, i, scratch, at, dest, item):  # type: ignore[no-untyped-def]
    """PLANES: plane j holds byte j of each `item`-byte element. A single zstd plane is
    decoded straight into `dest`."""
    if item == 1 and src[3][i, 0] == tf.ZSTD:
        return _decode_into(src, i, dest)
    grid = dest.reshape(-1, item)
    for j in range(item):
        ok, plane = _plane(src, i + j, scratch, at)
        if not ok:
            return False
        grid[:, j] = plane
    return True


@numba.njit(**_INNER)
def _bf16_segment(src, i, scratch, at, dest, base, seven):  # type: ignore[no-untyped-def]
    sizes = src[3][:, 1]
    ok1, sym = _plane(src, i, scratch, at)
    ok2, packed = _plane(src, i + 1, scratch, at + sizes[i])
    ok3, escapes = _plane(src, i + 2, scratch, at + sizes[i] + sizes[i + 1])
    if not (ok1 and ok2 and ok3):
        return False
    words = dest.view(np.uint16)
    if seven:
        _bf16_7(words, sym, packed, base)
    else:
        _bf16(words, sym, packed, base)
    return _patch(words, escapes, 0)


@numba.njit(**_INNER)
def _f16_segment(src, i, scratch, at, dest, layout):  # type: ignore[no-untyped-def]
    sizes = src[3][:, 1]
    ok1, sym = _plane(src, i, scratch, at)
    ok2, low = _plane(src, i + 1, scratch, at + sizes[i])
    if layout == tf.F16_BYTE:
        if ok1 and ok2:
            _f16(dest.view(np.uint16), sym, low)
        return ok1 and ok2
    ok3, signs = _plane(src, i + 2, scratch, at + sizes[i] + sizes[i + 1])
    if ok1 and ok2 and ok3:
        _f16_signs(dest.view(np.uint16), sym, low, signs)
    return ok1 and ok2 and ok3


@numba.njit(**_INNER)
def _f32_segment(src, i, scratch, at, dest, base):  # type: ignore[no-untyped-def]
    sizes = src[3][:, 1]
    ok1, sym = _plane(src, i, scratch, at)
    ok2, packed = _plane(src, i + 1, scratch, at + sizes[i])
    ok3, escapes = _plane(src, i + 2, scratch, at + sizes[i : i + 2].sum())
    ok4, byte1 = _plane(src, i + 3, scratch, at + sizes[i : i + 3].sum())
    ok5, byte0 = _plane(src, i + 4, scratch, at + sizes[i : i + 4].sum())
    if not (ok1 and ok2 and ok3 and ok4 and ok5):
        return False
    words = dest.view(np.uint32)
    _f32(words, sym, packed, base, byte1, byte0)
    return _patch(words, escapes, 16)


@numba.njit(types.boolean(types.int64, types.int64, _U8_IN, _TABLE, _TABLE, _U8, _U8), **_JIT)
def _decode(fn, dctx, payload, streams, segments, out, scratch):  # type: ignore[no-untyped-def]
    offsets = np.zeros(streams.shape[0] + 1, np.int64)
    for i in range(streams.shape[0]):
        offsets[i + 1] = offsets[i] + streams[i, 2]
    src = (fn, dctx, payload, streams, offsets)
    ok, plain = _plane(src, 0, scratch, 0)
    free = streams[0, 1]  # scratch[:free] holds the plain stream, the rest each segment's
    taken, i, pos = 0, 1, 0
    for s in range(segments.shape[0]):
        kind, param, n = segments[s, 0], segments[s, 1], segments[s, 2]
        dest = out[pos : pos + n]
        pos += n
        if kind == tf.PLAIN:
            dest[:] = plain[taken : taken + n]
            taken += n
        elif kind == tf.PLANES:
            ok &= _planes(src, i, scratch, free, dest, param)
            i += param
        elif kind == tf.F16:
            ok &= _f16_segment(src, i, scratch, free, dest, param)
            i += 2 if param == tf.F16_BYTE else 3
        elif kind == tf.F32:
            ok &= _f32_segment(src, i, scratch, free, dest, param)
            i += 5
        elif kind == tf.BF16 or kind == tf.BF16_7:
            ok &= _bf16_segment(src, i, scratch, free, dest, param, kind == tf.BF16_7)
            i += 3
        else:
            return False
        if not ok:
            return False
    return ok


_local = threading.local()


def decode_frame(frame: Frame, out: np.ndarray) -> bool:
    """Decode `frame` into `out` (u8, frame.raw_len bytes); False if a stream or an escape
    is damaged, in which case `out` holds garbage and the caller decodes it the slow way."""
    lib = libzstd.library()
    if lib is None:
        return False
    streams = np.array(frame.streams, np.int64).reshape(-1, 3)
    segments = np.array(frame.segments, np.int64).reshape(-1, 3)
    payload = np.frombuffer(frame.payload, np.uint8)
    scratch = _scratch(int(streams[:, 1].sum()))
    dctx = libzstd.thread_context(lib)
    return bool(_decode(lib.decompress, dctx, payload, streams, segments, out, scratch))


def _scratch(size: int) -> np.ndarray:
    """At least `size` bytes of this thread's scratch memory (kept up to `_KEEP_AT_MOST`)."""
    kept = getattr(_local, "scratch", None)
    if kept is not None and kept.size >= size:
        return kept
    fresh = np.empty(max(size, 1), np.uint8)
    if size <= _KEEP_AT_MOST:
        _local.scratch = fresh
    return fresh
