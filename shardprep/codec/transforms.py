"""Byte grouping and entropy coding: how one segment of a frame becomes streams and back.

Each float tensor is split, as ZipNN does, into a symbol stream that is entropy-coded and
a stream of near-random bits stored as they are, except that the symbol takes the top
mantissa bits along with the exponent. Segment kinds (stored as a byte, numbered in
`stored`):

- PLAIN: bytes that go into the frame's stream 0 (the header, gaps, small tensors, the
  elements cut by a frame edge), zstd level 3.
- BF16_7 (param = base exponent b, written now): symbol = 6 bits of exponent - b (the
  63 binades [b, b + 62], picked from a sample of the segment) and the top mantissa bit;
  the sign and the low 6 mantissa bits are packed eight elements to seven bytes
  (`_pack7`), raw; escapes (u32 positions, then u8 exponents) fix the rare elements
  outside the window. Symbols are zstd in a Huffman-only setting. Within a binade a
  bell-shaped weight distribution is not flat, so the top mantissa bit is not random
  given the exponent: MiniLM 1.510 with it in the symbol, 1.503 (ZipNN's ratio) with the
  exponent alone, 1.512 with 2 bits, and zstd decodes the 1-bit symbols fastest of the
  three (13.5, 14.1 and 14.6 ms). A segment with more than 1/32 of its elements outside
  every window (say, mostly exact zeros) is PLANES(2) instead.
- BF16 (param = b): the earlier layout, still decoded: symbol = 6 exponent bits and the
  top 2 mantissa bits, remainder = sign and the low 5, packed by `_pack6`.
- F16 (param = layout): symbol = 5 exponent bits and the top 2 mantissa bits; the low
  mantissa byte and the signs (one bit per element, sliced as `_slice_signs` says) are
  stored raw (`F16_SIGNS`, what is written). MiniLM 1.180. Its 7-bit symbols decode 8-13 %
  faster than the 8-bit ones of the earlier layout (`F16_BYTE`: the top 3 mantissa bits in
  the symbol, the remainder byte = sign and the low 7), which still decodes, at the same
  ratio (1.1795 against 1.1794 on MiniLM).
- F32 (param = base): the high halves as BF16 (the earlier layout), then the two low
  bytes as two planes. MiniLM: 1.225, against 1.217 for 4-plane byte grouping and 1.092
  for plain zstd.
- PLANES (param = item size): plane j holds byte j of every element. F8_E4M3 and F8_E5M2
  are PLANES(1) in the Huffman-only setting (e4m3 1.22x, e5m2 1.44x on randn scaled to
  the format's maximum; zstd levels 1-19 give the same within 0.01 and are slower).
  Other dtypes (integers, bool, F64) are PLANES(1) at zstd level 3, whose matches find
  the structure integer tensors have.

A stream is stored raw unless zstd saves 2 %. The Huffman-only setting is zstd's `fast`
strategy with min_match 7 and a 64-entry hash table: it finds almost no matches, so each
128 KiB block is literals under their own Huffman table (like ZipNN's 256 KiB chunks).
Decoders write into the caller's buffer, the float words rebuilt by `reassembly` (compiled
loops with numba, else numpy); bit fields are cut from u64 lanes, since numpy shifts 8-
and 16-bit integers one at a time but 64-bit lanes in bulk.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import zstandard

from shardprep.codec.reassembly import (
    join_bf16,
    join_bf16_7,
    join_f16,
    join_f16_signs,
    join_f32,
    spread,
)
from shardprep.codec.stored import (
    BF16,
    BF16_7,
    F16,
    F16_BYTE,
    F16_SIGNS,
    F32,
    LZ_BYTES,
    PLANES,
    RAW,
    ZSTD,
)
from shardprep.errors import CorruptFileError

_PAYS = 0.98  # keep a zstd stream only if it saves at least 2 %
_CHUNK = 1 << 17  # elements per numpy pass: keeps the temporaries in L2
_WINDOW = 63  # binades covered by a BF16 symbol; exponent field 63 marks an escape
_MAX_ESCAPE_SHARE = 1 / 32
_SAMPLE_STEP = 16
_LANE32 = np.uint32(0x01010101)  # times a byte mask: that mask in each byte of a u32

Plane = bytes | memoryview | np.ndarray
Encoded = tuple[int, int, list[Plane], bool]  # kind, param, planes, lz


def plane_sizes(kind: int, param: int, n: int) -> list[int] | None:
    """Raw size of each stream of an n-byte segment (-k: escapes, at most k bytes); None
    if no encoder writes such a segment."""
    item = {BF16: 2, BF16_7: 2, F16: 2, F32: 4, PLANES: param}.get(kind, 0)
    windowed = kind in (BF16, BF16_7, F32)
    if item == 0 or item > 8 or n % (32 * item) or (windowed and param > 256 - 1 - _WINDOW):
        return None
    if kind == F16 and param not in (F16_BYTE, F16_SIGNS):
        return None
    count = n // item
    escapes = -5 * count
    return {
        BF16: [count, count // 4 * 3, escapes],
        BF16_7: [count, count // 8 * 7, escapes],
        F16: [count, count] if param == F16_BYTE else [count, count, count // 8],
        F32: [count, count // 4 * 3, escapes, count, count],
        PLANES: [count] * item,
    }[kind]


# ---------------------------------------------------------------------------- zstd

_local = threading.local()


def pack(plane: Plane, lz: bool) -> tuple[int, int, Plane]:
    """(method, raw length, stored bytes): zstd where it pays, else the plane itself."""
    view = memoryview(plane)
    size = view.nbytes
    if size == 0:
        return RAW, 0, b""
    packed = _zstd_compressor(lz).compress(view)
    if len(packed) <= size * _PAYS:
        return ZSTD, size, packed
    return RAW, size, plane


def unpack(method: int, stored: memoryview, size: int, where: str) -> np.ndarray:
    """The raw bytes of one stream, whose sizes the container has already checked."""
    if method == RAW:
        return np.frombuffer(stored, np.uint8)
    try:
        # Checked first, so a damaged size field cannot make zstd allocate it.
        if zstandard.frame_content_size(stored) != size:
            raise zstandard.ZstdError("the zstd frame header gives another size")
        data = _zstd_decompressor().decompress(stored)
    except zstandard.ZstdError as exc:
        raise CorruptFileError(f"{where}: {exc}") from None
    if len(data) != size:
        raise CorruptFileError(f"{where} decompresses short")
    return np.frombuffer(data, np.uint8)


def _zstd_compressor(lz: bool) -> zstandard.ZstdCompressor:
    """Per thread: level 3 (`lz`) or the Huffman-only setting for float-derived planes."""
    cache = _local.__dict__.setdefault("compressors", {})
    if lz not in cache:
        common = {"write_content_size": True, "write_checksum": False, "write_dict_id": False}
        if lz:
            params = zstandard.ZstdCompressionParameters.from_level(3, **common)
        else:
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST,
                window_log=17,  # blocks are min(window, 128 KiB): one Huffman table each
                hash_log=6,
                chain_log=6,
                search_log=1,
                min_match=7,
                target_length=0,  # a positive target length turns Huffman off
                **common,
            )
        cache[lz] = zstandard.ZstdCompressor(compression_params=params)
    return cache[lz]


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


# ---------------------------------------------------------------------------- encoders


def _encode_planes(data: memoryview, item: int, lz: bool = False) -> Encoded:
    if item == 1:
        return PLANES, 1, [data], lz
    grid = np.frombuffer(data, np.uint8).reshape(-1, item)
    return PLANES, item, [np.ascontiguousarray(grid[:, j]) for j in range(item)], lz


def _encode_lz_bytes(data: memoryview, item: int) -> Encoded:
    return _encode_planes(data, 1, lz=True)


def _encode_bf16(data: memoryview, item: int) -> Encoded:
    words = np.frombuffer(data, "<u2")
    base = _pick_base(words)
    if base is None:
        return _encode_planes(data, 2, lz=True)  # runs of zeros: LZ beats Huffman
    return BF16_7, base, list(_split_bf16(words, base, top=1)), False


def _encode_f16(data: memoryview, item: int) -> Encoded:
    words = np.frombuffer(data, "<u2")
    sym, low, sign = (np.empty(words.size, np.uint8) for _ in range(3))
    for i in range(0, words.size, _CHUNK):
        chunk, end = words[i : i + _CHUNK], min(i + _CHUNK, words.size)
        np.copyto(sym[i:end], _lanes(chunk, 8, 0x7F), casting="unsafe")
        np.copyto(low[i:end], _lanes(chunk, 0, 0xFF), casting="unsafe")
        np.copyto(sign[i:end], _lanes(chunk, 15, 0x01), casting="unsafe")
    return F16, F16_SIGNS, [sym, low, _slice_signs(sign)], False


def _slice_signs(sign: np.ndarray) -> np.ndarray:
    """Signs (bytes 0 or 1) of n elements (n % 32 == 0) in n/8 bytes: bit k of byte j is
    the sign of element k * n/8 + j (`reassembly.join_f16_signs`). In 32-bit lanes, which
    numpy shifts in bulk (the bits of a byte never reach the next one)."""
    rows = sign.view(np.uint32).reshape(8, -1)
    out = rows[0].copy()
    for k in range(1, 8):
        out |= rows[k] << np.uint32(k)
    return out.view(np.uint8)


def _encode_f32(data: memoryview, item: int) -> Encoded:
    high = np.frombuffer(data, "<u2")[1::2].copy()
    base = _pick_base(high)
    if base is None:
        return _encode_planes(data, 4, lz=True)
    grid = np.frombuffer(data, np.uint8).reshape(-1, 4)
    low = [np.ascontiguousarray(grid[:, 1]), np.ascontiguousarray(grid[:, 0])]
    return F32, base, [*_split_bf16(high, base, top=2), *low], False


def _pick_base(words: np.ndarray) -> int | None:
    """Lowest exponent of the 63-binade window holding most of a sample of bf16 words.

    None when more than 1/32 of the sample falls outside every window (say, many zeros).
    """
    sample = (words[::_SAMPLE_STEP] >> 7) & 0xFF
    counts = np.cumsum(np.bincount(sample, minlength=256), dtype=np.int64)
    window = counts[_WINDOW - 1 :] - np.concatenate(([0], counts[: 256 - _WINDOW]))
    base = int(np.argmax(window[: 256 - _WINDOW]))  # base + 63 must stay below 256
    if window[base] < sample.size * (1 - _MAX_ESCAPE_SHARE):
        return None
    return base


def _split_bf16(
    words: np.ndarray, base: int, top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symbol, packed remainder and escape planes of bf16 words (a multiple of 32).

    symbol = (exponent - base) << top | the top `top` mantissa bits, or 63 << top | those
    bits (escape); remainder = sign and the other mantissa bits, packed by `_pack7`
    (top 1: BF16_7) or `_pack6` (top 2: F32's high halves, and earlier BF16 segments).
    """
    n = words.size
    sym, rem = np.empty(n, np.uint8), np.empty(n, np.uint8)
    escapes = []
    for i in range(0, n, _CHUNK):
        chunk = words[i : i + _CHUNK]
        escapes.append(_window_symbols(chunk, base, top, sym[i : i + chunk.size]) + i)
        _remainder(chunk, 7 - top, rem[i : i + chunk.size])
    return sym, _pack7(rem) if top == 1 else _pack6(rem), _escape_plane(words, escapes)


def _window_symbols(chunk: np.ndarray, base: int, top: int, out: np.ndarray) -> np.ndarray:
    """out = (exponent - base) << top | the top `top` mantissa bits, with exponent - base
    replaced by 63 (escape) outside the window; returns the escapes' positions."""
    field = _lanes(chunk, 7 - top, (0x100 << top) - 1)
    field -= np.uint16(base << top)  # wraps below the window: one comparison finds both ends
    escape = _WINDOW << top
    hit = np.flatnonzero(field >= escape)
    if hit.size:
        field[hit] = escape | (field[hit] & ((1 << top) - 1))
    np.copyto(out, field, casting="unsafe")
    return hit


def _escape_plane(words: np.ndarray, escapes: list[np.ndarray]) -> np.ndarray:
    """u32 positions, then u8 exponents, of the elements outside the window."""
    where = np.concatenate(escapes) if escapes else np.empty(0, np.int64)
    exponents = ((words[where] >> 7) & 0xFF).astype(np.uint8)
    return np.concatenate([where.astype("<u4").view(np.uint8), exponents])


def _lanes(words: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """(words >> shift) & mask for u16 words (a multiple of 4), as a new u16 array."""
    lanes = words.view(np.uint64) >> np.uint64(shift)
    lanes &= spread(mask, 2)
    return lanes.view(np.uint16)


def _remainder(words: np.ndarray, shift: int, out: np.ndarray) -> None:
    """Sign in bit 7 and the low `shift` bits of each u16 word, as bytes."""
    lanes = words.view(np.uint64)
    low = lanes & spread((1 << shift) - 1, 2)
    sign = lanes >> np.uint64(8)
    sign &= spread(0x80, 2)
    low |= sign
    np.copyto(out, low.view(np.uint16), casting="unsafe")


def _pack6(rem: np.ndarray) -> np.ndarray:
    """Remainders 's00mmmmm' of n elements (n % 32 == 0) into 3n/4 bytes.

    The first 3n/4 bytes keep their own remainder; bits 5-6 of bytes j, j + n/4 and
    j + n/2 carry the 6 bits of element 3n/4 + j, two at a time (m1 m0, m3 m2, s m4).
    Undoing this takes a few numpy passes where entropy-coding 6-bit values would take a
    Huffman decode as long as the symbols'.
    """
    quarter = rem.size // 4
    tail = rem[3 * quarter :].view(np.uint64)
    heads = [rem[k * quarter : (k + 1) * quarter].view(np.uint64) for k in range(3)]
    heads[0] |= (tail << np.uint64(5)) & spread(0x60, 1)
    heads[1] |= (tail << np.uint64(3)) & spread(0x60, 1)
    heads[2] |= (tail << np.uint64(1)) & spread(0x20, 1)
    heads[2] |= (tail >> np.uint64(1)) & spread(0x40, 1)
    return rem[: 3 * quarter]


def _pack7(rem: np.ndarray) -> np.ndarray:
    """Remainders 's0mmmmmm' of n elements (n % 32 == 0) into 7n/8 bytes.

    The first 7n/8 bytes keep their own remainder; bit 6 of bytes j, j + n/8, ...,
    j + 6n/8 carries bit 0, 1, ..., 6 of element 7n/8 + j's value 'smmmmmm'. In 32-bit
    lanes (n/8 is a multiple of 4), which numpy shifts in bulk.
    """
    eighth = rem.size // 8
    tail = rem[7 * eighth :].view(np.uint32)
    value = (tail & _LANE32 * 0x3F) | ((tail >> np.uint32(1)) & _LANE32 * 0x40)
    for k in range(7):
        head = rem[k * eighth : (k + 1) * eighth].view(np.uint32)
        head |= (value << np.uint32(6 - k)) & _LANE32 * 0x40
    return rem[: 7 * eighth]


# ---------------------------------------------------------------------------- decoders
#
# Each fills `dest` (a segment of the caller's output buffer) from the segment's planes.


def _decode_planes(dest: np.ndarray, param: int, planes: list[np.ndarray]) -> None:
    if param == 1:
        dest[:] = planes[0]
        return
    grid = dest.reshape(-1, param)
    for j, plane in enumerate(planes):
        grid[:, j] = plane


def _decode_bf16(dest: np.ndarray, base: int, planes: list[np.ndarray]) -> None:
    words = dest.view("<u2")
    join_bf16(words, planes[0], planes[1], base)
    _patch_escapes(words, planes[2])


def _decode_bf16_7(dest: np.ndarray, base: int, planes: list[np.ndarray]) -> None:
    words = dest.view("<u2")
    join_bf16_7(words, planes[0], planes[1], base)
    _patch_escapes(words, planes[2])


def _decode_f16(dest: np.ndarray, param: int, planes: list[np.ndarray]) -> None:
    if param == F16_BYTE:
        join_f16(dest.view("<u2"), planes[0], planes[1])
    else:
        join_f16_signs(dest.view("<u2"), planes[0], planes[1], planes[2])


def _decode_f32(dest: np.ndarray, base: int, planes: list[np.ndarray]) -> None:
    join_f32(dest.view("<u4"), planes[0], planes[1], base, planes[3], planes[4])
    _patch_escapes(dest.view("<u2")[1::2], planes[2])  # the high halves


def _patch_escapes(words: np.ndarray, escapes: np.ndarray) -> None:
    count = escapes.size // 5
    if not count:
        return
    where = escapes[: 4 * count].view("<u4")
    if int(where.max()) >= words.size:
        raise CorruptFileError("an escape points outside its segment")
    words[where] = (words[where] & 0x807F) | (escapes[4 * count :].astype(np.uint16) << 7)


ENCODERS: dict[int, Callable[[memoryview, int], Encoded]] = {
    PLANES: _encode_planes,
    LZ_BYTES: _encode_lz_bytes,
    BF16_7: _encode_bf16,
    F16: _encode_f16,
    F32: _encode_f32,
}
DECODERS: dict[int, Callable[[np.ndarray, int, list[np.ndarray]], None]] = {
    PLANES: _decode_planes,
    BF16: _decode_bf16,
    BF16_7: _decode_bf16_7,
    F16: _decode_f16,
    F32: _decode_f32,
}
