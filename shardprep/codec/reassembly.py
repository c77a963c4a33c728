"""Reassembling float words from their symbol and remainder planes (see `transforms`).

Each join has a numpy form (a few vectorised passes per cache-sized chunk) and, when numba
is installed, a compiled one (`compiled`): a single pass that releases the GIL, several
times faster. With numba and a system libzstd, a whole frame is decoded in one compiled
call (`compiled.decode_frame`). All write the same bytes (the tests hold them to it), so
the stored format does not depend on which one ran. `use_compiled(False)` forces numpy.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Literal

import numpy as np

from shardprep.codec import libzstd
from shardprep.codec.stored import Frame
from shardprep.errors import CorruptFileError

FrameDecoder = Callable[[Frame, np.ndarray], bool]  # (frame, out) -> decoded

# Passes of 256 Ki elements: a typical tensor segment (up to 256 Ki elements) is then one
# chunk, not one and a sliver; 5 % less CPU on MiniLM than 128 Ki, no slower on 1 GiB.
_DECODE_CHUNK = 1 << 18

# Compiling takes about 10 s, once per installation (numba's cache then loads it in under
# half a second): past this many seconds a line says why nothing moves.
COMPILE_NOTICE_S = 2.0
_COMPILING = "Compiling the codec's decoder with numba (once per installation, about 10 s)."

logger = logging.getLogger("shardprep.codec")

_compiled: ModuleType | Literal[False] | None = None  # None: not tried yet; False: numpy only
_frames: FrameDecoder | Literal[False] | None = None  # the same, for `frame_decoder`


def compiled() -> ModuleType | None:
    """The compiled joins, imported (and compiled) on first use; None without numba."""
    global _compiled
    if _compiled is None:
        notice = threading.Timer(COMPILE_NOTICE_S, logger.warning, [_COMPILING])
        notice.daemon = True
        notice.start()
        try:
            if sys.byteorder != "little":
                raise ImportError("the compiled joins assume little-endian words")
            module = importlib.import_module("shardprep.codec.compiled")
        except ImportError:
            _compiled = False
        except Exception as exc:  # numba present but unusable here (say, no cache dir)
            logger.warning("Decoding with numpy: numba could not compile the joins (%s).", exc)
            _compiled = False
        else:
            _compiled = module
        finally:
            notice.cancel()
    return _compiled or None


def frame_decoder() -> FrameDecoder | None:
    """`compiled.decode_frame` where numba and a system libzstd are both there."""
    global _frames
    if _frames is None:
        fast = compiled()
        _frames = fast.decode_frame if fast and libzstd.library() else False
    return _frames or None


def use_compiled(enabled: bool, *, frames: bool = True) -> None:
    """Use the compiled joins when numba is installed (True, the default) or numpy only;
    `frames=False` keeps the joins compiled but decodes frames stream by stream."""
    global _compiled, _frames
    _compiled = None if enabled else False
    _frames = None if enabled and frames else False


def _check(what: str, *sizes: int) -> None:
    if len(set(sizes)) != 1:
        raise CorruptFileError(f"the planes of a {what} segment differ in size: {sizes}")


def join_bf16(out: np.ndarray, sym: np.ndarray, packed: np.ndarray, base: int) -> None:
    """u16 `out` from BF16 symbols and 6-bit remainders (escapes not yet patched)."""
    _check("BF16", out.size - out.size % 4, out.size, sym.size, packed.size // 3 * 4)
    fast = compiled()
    if fast is not None:
        fast.join_bf16(out, sym, packed, base)
    else:
        _numpy_join_bf16(out, sym, packed, base)


def join_f16(out: np.ndarray, sym: np.ndarray, rem: np.ndarray) -> None:
    """u16 `out` = sym << 7 | sign << 15 | low 7 mantissa bits (sign in bit 7 of rem)."""
    _check("F16", out.size, sym.size, rem.size)
    fast = compiled()
    if fast is not None:
        fast.join_f16(out, sym, rem)
        return
    wide = np.empty(min(_DECODE_CHUNK, out.size), np.int16)
    for i in range(0, out.size, _DECODE_CHUNK):
        part = out[i : i + _DECODE_CHUNK]
        np.copyto(part, sym[i : i + part.size])
        part *= np.uint16(1 << 7)
        _or_remainder(part, rem[i : i + part.size], 0x7F, wide)


def join_bf16_7(out: np.ndarray, sym: np.ndarray, packed: np.ndarray, base: int) -> None:
    """u16 `out` from BF16_7 symbols and 7-bit remainders (escapes not yet patched)."""
    _check("BF16", out.size - out.size % 32, out.size, sym.size, packed.size // 7 * 8)
    fast = compiled()
    if fast is not None:
        fast.join_bf16_7(out, sym, packed, base)
        return
    eighth = out.size // 8
    head = 7 * eighth
    wide = np.empty(min(_DECODE_CHUNK, out.size), np.int16)
    tail = np.empty(eighth, np.uint8)
    for i in range(0, out.size, _DECODE_CHUNK):
        part = out[i : i + _DECODE_CHUNK]
        np.copyto(part, sym[i : i + part.size])
        part *= np.uint16(1 << 6)  # numpy multiplies u16 in SIMD but shifts them one by one
        part += np.uint16(base << 7)
    for i in range(0, head, _DECODE_CHUNK):
        rem = packed[i : min(i + _DECODE_CHUNK, head)]
        _or_remainder(out[i:], rem, 0x3F, wide)
    _unpack7([packed[k * eighth : (k + 1) * eighth] for k in range(7)], tail)
    for i in range(0, eighth, _DECODE_CHUNK):
        _or_remainder(out[head + i :], tail[i : i + _DECODE_CHUNK], 0x3F, wide)


def join_f16_signs(out: np.ndarray, sym: np.ndarray, low: np.ndarray, signs: np.ndarray) -> None:
    """u16 `out` = sign << 15 | sym << 8 | low: `sym` the exponent and top 2 mantissa bits,
    `low` the low byte, `signs` one bit per element, sliced: with q = out.size / 8, bit k
    of byte j is the sign of element k * q + j (so each pass over the bytes is contiguous,
    as `_pack6` is)."""
    _check("F16", out.size, sym.size, low.size, signs.size * 8)
    fast = compiled()
    if fast is not None:
        fast.join_f16_signs(out, sym, low, signs)
        return
    eighth = signs.size
    for k in range(8):
        for j in range(0, eighth, _DECODE_CHUNK):
            i, part = k * eighth + j, signs[j : j + _DECODE_CHUNK]
            dest = out[i : i + part.size]
            np.copyto(dest, sym[i : i + part.size])
            dest <<= np.uint16(8)
            dest |= low[i : i + part.size]
            dest |= ((part >> np.uint8(k)) & np.uint8(1)).astype(np.uint16) << np.uint16(15)


def join_f32(
    out: np.ndarray,
    sym: np.ndarray,
    packed: np.ndarray,
    base: int,
    byte1: np.ndarray,
    byte0: np.ndarray,
) -> None:
    """u32 `out` = high << 16 | byte1 << 8 | byte0, the high halves joined as `join_bf16`
    (escapes not yet patched)."""
    _check("F32", out.size - out.size % 4, out.size, sym.size, packed.size // 3 * 4)
    _check("F32", out.size, byte1.size, byte0.size)
    fast = compiled()
    if fast is not None:
        fast.join_f32(out, sym, packed, base, byte1, byte0)
        return
    high = np.empty(out.size, "<u2")
    _numpy_join_bf16(high, sym, packed, base)
    # Widen and multiply: numpy does these in SIMD, strided byte stores one at a time.
    low = np.empty(min(_DECODE_CHUNK, out.size), np.uint32)
    for i in range(0, out.size, _DECODE_CHUNK):
        part = out[i : i + _DECODE_CHUNK]
        end, tmp = i + part.size, low[: part.size]
        np.copyto(part, high[i:end])
        part *= np.uint32(1 << 16)
        np.copyto(tmp, byte1[i:end])
        tmp *= np.uint32(1 << 8)
        part |= tmp
        np.copyto(tmp, byte0[i:end])
        part |= tmp


# ---------------------------------------------------------------------------- numpy


def spread(byte_mask: int, width: int) -> np.uint64:
    """`byte_mask` (of `width` bytes) repeated over a u64 lane."""
    return np.uint64(int.from_bytes(byte_mask.to_bytes(width, "little") * (8 // width), "little"))


def _numpy_join_bf16(out: np.ndarray, sym: np.ndarray, packed: np.ndarray, base: int) -> None:
    """Inverse of `transforms._split_bf16` (top 2) without the escapes, in cache-sized chunks."""
    quarter = out.size // 4
    head = 3 * quarter
    offset = np.uint16(base << 7)
    wide = np.empty(min(_DECODE_CHUNK, out.size), np.int16)
    tail = np.empty(min(_DECODE_CHUNK, quarter), np.uint8)
    lanes = np.empty(tail.size // 8, np.uint64)
    for i in range(0, out.size, _DECODE_CHUNK):
        part = out[i : i + _DECODE_CHUNK]
        end = i + part.size
        np.copyto(part, sym[i:end])
        part *= np.uint16(1 << 5)  # numpy multiplies u16 in SIMD but shifts them one by one
        part += offset
        if i < head:
            _or_remainder(part, packed[i : min(end, head)], 0x1F, wide)
        if end > head:
            lo, hi = max(i, head) - head, end - head
            _unpack6_tail(packed, quarter, lo, hi, tail[: hi - lo], lanes)
            _or_remainder(out[head + lo : head + hi], tail[: hi - lo], 0x1F, wide)


def _unpack6_tail(
    packed: np.ndarray, quarter: int, lo: int, hi: int, out: np.ndarray, scratch: np.ndarray
) -> None:
    """Remainder bytes 's00mmmmm' of tail elements lo..hi (multiples of 8), into `out`."""
    heads = [packed[k * quarter + lo : k * quarter + hi].view(np.uint64) for k in range(3)]
    lanes = out.view(np.uint64)
    tmp = scratch[: lanes.size]
    np.right_shift(heads[0], np.uint64(5), out=lanes)
    lanes &= spread(0x03, 1)
    for source, shift, mask in ((1, 3, 0x0C), (2, 1, 0x10)):
        np.right_shift(heads[source], np.uint64(shift), out=tmp)
        tmp &= spread(mask, 1)
        lanes |= tmp
    np.left_shift(heads[2], np.uint64(1), out=tmp)
    tmp &= spread(0x80, 1)
    lanes |= tmp


def _unpack7(carriers: list[np.ndarray], out: np.ndarray) -> None:
    """Remainder bytes 's0mmmmmm' from bit 6 of seven carrier byte runs (`_pack7`)."""
    lanes, one = out.view(np.uint32), np.uint32(0x01010101)
    lanes[:] = 0
    for k, carrier in enumerate(carriers):
        lanes |= (carrier.view(np.uint32) >> np.uint32(6 - k)) & one * (1 << k)
    lanes |= (lanes << np.uint32(1)) & one * 0x80  # the sign, from bit 6 to bit 7
    lanes &= one * 0xBF


def _or_remainder(out: np.ndarray, rem: np.ndarray, low_mask: int, wide: np.ndarray) -> None:
    """out[:len(rem)] |= sign << 15 | (rem & low_mask), for bytes with the sign in bit 7."""
    tmp = wide[: rem.size]
    np.copyto(tmp, rem.view(np.int8))  # widening an int8 copies the sign into bits 8..15
    tmp &= np.int16(-0x8000 | low_mask)
    out[: rem.size] |= tmp.view(np.uint16)
