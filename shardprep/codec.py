"""Transport compression for safetensors files: a registry of codecs by name.

``"none"`` is the identity (the file itself). ``"zstd"`` is a framed container of zstd
streams in which each float tensor is first split, as ZipNN does, into a symbol stream
that is entropy-coded and a stream of near-random bits stored as they are, except that
the symbol takes the top mantissa bits along with the exponent.

Container (all integers little-endian)::

    file    = FileHeader Frame* Trailer
    FileHeader (24 B) = b"\\x89SPZ\\r\\n\\x1a\\n" | version u16 (1) | flags u16 (0)
                        | frame_size u32 | raw_size u64
    Frame   = b"SPFR" | raw_len u32 | n_segments u32 | n_streams u32
              | n_segments x Segment | n_streams x Stream | the stored bytes of each stream
    Segment (8 B)  = kind u8 | param u8 | 0 u16 | raw_len u32
    Stream (12 B)  = method u8 (0 raw, 1 zstd frame) | 0 u8 x3 | raw_len u32 | stored_len u32
    Trailer (56 B) = b"SPEND\\0\\0\\0" | n_frames u64 | raw_size u64 | sha256 of the raw bytes

Read as a safetensors header length, the magic is far over any limit: the two never mix.
Frame k holds raw bytes [k * frame_size, (k + 1) * frame_size) of the original file and
depends on nothing else, so frames are coded in parallel and the output does not depend
on the number of threads. The safetensors header (parsed here; lengths over 100,000,000
refused) cuts a frame into segments. Stream 0 holds the bytes of the frame's PLAIN
segments (the header, gaps, tensors under 4 KiB, up to 31 elements at a frame edge or a
tensor end), zstd level 3. The other streams follow the segments in order:

- BF16 (param = base exponent b): symbol byte = 6 bits of exponent - b (the 63 binades
  [b, b + 62], picked from a sample of the segment) and the top 2 mantissa bits; the
  remaining sign and 5 mantissa bits are packed four elements to three bytes and stored
  raw; escapes (u32 positions, then u8 exponents) fix the rare elements outside the
  window. Symbols are zstd in a Huffman-only setting. Coding the top mantissa bits with
  the exponent is what takes the ratio past ZipNN's exponent-only Huffman: within a
  binade a bell-shaped weight distribution is not flat, so those bits are not random
  given the exponent (randn * 0.02: 1.522 vs ZipNN's 1.510; MiniLM 1.513 vs 1.503;
  exponent alone, sign moved out: 1.509). A segment with more than 1/32 of its
  elements outside every window (say, mostly exact zeros) is PLANES(2) instead.
- F16: symbol = 5 exponent bits and the top 3 mantissa bits, remainder byte = sign and
  the low 7 mantissa bits (random: stored raw). MiniLM 1.180, as high/low byte planes.
- F32 (param = base): the high halves as BF16, then the two low bytes as two planes.
  Measured on MiniLM: 1.225, against 1.217 for 4-plane byte grouping and 1.092 for zstd
  on the plain bytes (ZipNN 1.220).
- PLANES (param = item size): plane j holds byte j of every element. F8_E4M3 and F8_E5M2
  are PLANES(1) in the Huffman-only setting. Measured (tensors scaled to the format's
  maximum, as fp8 checkpoints are): e4m3 1.222x on randn and 1.212x on MiniLM, e5m2
  1.444x and 1.427x; zstd levels 1, 3 and 19 give the same ratios within 0.01 (the
  bytes are independent symbols, LZ matches find nothing) and are slower; raw is 1.0x.
  Other dtypes (integers, bool, F64) are PLANES(1) at zstd level 3, whose matches find
  the structure integer tensors have.

A stream is stored raw unless zstd saves 2 %. The Huffman-only setting is zstd's `fast`
strategy with min_match 7 and a 64-entry hash table: it finds almost no matches, so each
128 KiB block is literals under their own Huffman table (like ZipNN's 256 KiB chunks).

Frames default to 4 MiB of raw input: one frame's working set stays in cache, small files
still spread over the threads, and glibc recycles the buffers (decoding bf16 on one core:
1.5-1.6 GB/s with 1-4 MiB frames, 1.2 with 16 MiB, 0.4 with 64 MiB, above glibc's mmap
threshold, where every buffer is faulted in afresh). At most ``threads + 1`` frames are in flight,
so memory stays a few frames whatever the file size. Decompression checks every size
before allocating, then the sha256 of the restored bytes against the trailer, and raises
CorruptFileError on a mismatch, a zstd error, inconsistent tables or truncation.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import shutil
import struct
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

import numpy as np
import zstandard

from shardprep.constants import INCOMPLETE_SUFFIX, MAX_HEADER_BYTES
from shardprep.errors import ConfigError, CorruptFileError

DEFAULT_FRAME_SIZE = 4 * 1024**2
MIN_FRAME_SIZE = 4096
MAX_FRAME_SIZE = 256 * 1024**2
MAX_DEFAULT_THREADS = 8

MAGIC = b"\x89SPZ\r\n\x1a\n"
VERSION = 1
_FILE_HEADER = struct.Struct("<8sHHIQ")
_FRAME_MAGIC = b"SPFR"
_FRAME_HEADER = struct.Struct("<4sIII")
_SEGMENT = struct.Struct("<BBHI")
_STREAM = struct.Struct("<B3xII")
_TRAILER_MAGIC = b"SPEND\0\0\0"
_TRAILER = struct.Struct("<8sQQ32s")

_PLAIN, _PLANES, _BF16, _F16, _F32 = range(5)  # segment kinds, as stored
_LZ_BYTES = 5  # planned only: stored as PLANES(1), compressed with zstd level 3
_RAW, _ZSTD = 0, 1

_MIN_SEGMENT_BYTES = 4096  # below this the stream overheads outweigh the split
_PAYS = 0.98  # keep a zstd stream only if it saves at least 2 %
_CHUNK = 1 << 18  # elements per numpy pass: keeps the temporaries in L2
_WINDOW = 63  # binades covered by a BF16 symbol; symbol 63 << 2 marks an escape
_ESCAPE = _WINDOW << 2
_MAX_ESCAPE_SHARE = 1 / 32
_SAMPLE_STEP = 16

_IO_CHUNK = 16 * 1024**2

# dtype -> (kind, item size); any other dtype (integers, bool, F64...) is _LZ_BYTES.
_DTYPE_KINDS = {
    "BF16": (_BF16, 2),
    "F16": (_F16, 2),
    "F32": (_F32, 4),
    "F8_E4M3": (_PLANES, 1),
    "F8_E5M2": (_PLANES, 1),
}


@dataclass(frozen=True)
class CodecResult:
    """Sizes and sha256 (hex) of the raw (original) and the stored (compressed) bytes."""

    raw_bytes: int
    stored_bytes: int
    raw_sha256: str
    stored_sha256: str


# ---------------------------------------------------------------------------- registry


class Codec(Protocol):
    """A transport codec: `magic` opens every file it writes (b"" for the identity)."""

    name: str
    magic: bytes

    def compress(
        self, src: _HashingReader, dst: _HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        """Write the stored form of the safetensors bytes of `src` to `dst`."""

    def decompress(self, src: _HashingReader, dst: _HashingWriter, *, threads: int) -> bytes | None:
        """Write the raw bytes to `dst`; return the raw sha256 the file promises, if any."""


_CODECS: dict[str, Codec] = {}
_C = TypeVar("_C")


def register_codec(name: str) -> Callable[[type[_C]], type[_C]]:
    """Class decorator: register a codec under `name`. Registering again is a no-op."""

    def wrap(cls: type[_C]) -> type[_C]:
        known = _CODECS.get(name)
        if known is None or type(known).__qualname__ != cls.__qualname__:
            _CODECS[name] = cls()  # type: ignore[assignment]
        return cls

    return wrap


def codec_names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    """The codec registered as `name`; a miss lists the choices."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ConfigError(
            f"Unknown codec {name!r}; choose one of: {', '.join(codec_names())}."
        ) from None


# ---------------------------------------------------------------------------- public API


def compress_file(
    src: Path,
    dst: Path,
    codec: str = "zstd",
    *,
    threads: int | None = None,
    frame_size: int = DEFAULT_FRAME_SIZE,
) -> CodecResult:
    """Compress the safetensors file `src` into `dst` (written under a temporary name).

    `threads` frames are coded at once (default: the usable cores, at most 8; with more
    than one, the two sha256 also run on threads of their own). `frame_size` is the raw
    bytes per independent frame. The output bytes do not depend on `threads`. Raises
    ConfigError for a bad option and CorruptFileError if `src` is not a safetensors file.
    """
    impl = get_codec(codec)
    n_threads = _resolve_threads(threads)
    if not MIN_FRAME_SIZE <= frame_size <= MAX_FRAME_SIZE:
        raise ConfigError(
            f"frame_size={frame_size} is out of range: use {MIN_FRAME_SIZE} to "
            f"{MAX_FRAME_SIZE} bytes (the default is {DEFAULT_FRAME_SIZE})."
        )
    src, dst = Path(src), Path(dst)
    with (
        open(src, "rb") as raw_file,
        _atomic_output(dst, like=src) as out_file,
        _sha256_pair(n_threads) as (raw_sha, stored_sha),
    ):
        reader = _HashingReader(raw_file, str(src), raw_sha)
        writer = _HashingWriter(out_file, stored_sha)
        impl.compress(reader, writer, threads=n_threads, frame_size=frame_size)
        return CodecResult(reader.count, writer.count, reader.hexdigest(), writer.hexdigest())


def decompress_file(src: Path, dst: Path, *, threads: int | None = None) -> CodecResult:
    """Restore the original file from `src` into `dst`, verifying its recorded sha256.

    The codec is recognised by the file's first bytes; a plain safetensors file is the
    "none" codec and is copied. Raises CorruptFileError if `src` is damaged or truncated.
    """
    n_threads = _resolve_threads(threads)
    src, dst = Path(src), Path(dst)
    with open(src, "rb") as stored_file:
        impl = _detect_codec(stored_file.read(8), src)
        stored_file.seek(0)
        with (
            _atomic_output(dst, like=src) as out_file,
            _sha256_pair(n_threads) as (raw_sha, stored_sha),
        ):
            reader = _HashingReader(stored_file, str(src), stored_sha)
            writer = _HashingWriter(out_file, raw_sha)
            try:
                expected = impl.decompress(reader, writer, threads=n_threads)
            except CorruptFileError as exc:
                raise CorruptFileError(_corrupt_message(src, str(exc)), path=str(src)) from exc
            if expected is not None and expected != writer.digest():
                reason = "the sha256 of the restored bytes differs from the one recorded"
                raise CorruptFileError(_corrupt_message(src, reason), path=str(src))
            return CodecResult(writer.count, reader.count, writer.hexdigest(), reader.hexdigest())


def _corrupt_message(src: Path, reason: str) -> str:
    return f"Compressed file {src} is corrupt: {reason}. Fetch or compress it again."


def _resolve_threads(threads: int | None) -> int:
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(cores or 1, MAX_DEFAULT_THREADS))
    if threads < 1:
        raise ConfigError(f"threads={threads}: use 1 or more (or leave it unset).")
    return threads


def _detect_codec(head: bytes, src: Path) -> Codec:
    for impl in _CODECS.values():
        if impl.magic and head.startswith(impl.magic):
            return impl
    if len(head) == 8 and struct.unpack("<Q", head)[0] <= MAX_HEADER_BYTES:
        return get_codec("none")
    reason = f"it is neither a shardprep container nor a safetensors file (starts {head!r})"
    raise CorruptFileError(_corrupt_message(src, reason), path=str(src))


@contextmanager
def _atomic_output(dst: Path, like: Path) -> Iterator[BinaryIO]:
    """Yield a temporary file next to `dst`; rename it to `dst` only if the block succeeds."""
    fd, tmp_name = tempfile.mkstemp(
        prefix=f".{dst.name}.", suffix=INCOMPLETE_SUFFIX, dir=dst.parent
    )
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        shutil.copymode(like, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Hash(Protocol):
    def update(self, data: bytes | memoryview | np.ndarray, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


class _HashingReader:
    """Reads a binary stream, hashing (sha256 unless told) and counting what it hands out."""

    def __init__(self, handle: BinaryIO, name: str, sha: _Hash | None = None) -> None:
        self._handle = handle
        self.name = name
        self.count = 0
        self._sha = hashlib.sha256() if sha is None else sha

    def read(self, size: int) -> bytes:
        data = self._handle.read(size)
        self._sha.update(data)
        self.count += len(data)
        return data

    def read_exact(self, size: int, what: str) -> bytes:
        data = self.read(size)
        if len(data) != size:
            raise CorruptFileError(f"truncated: {what} ends after {len(data)} of {size} bytes")
        return data

    def read_at(self, size: int, offset: int) -> bytes:
        """Bytes at `offset`, without moving the stream or hashing (header parsing)."""
        position = self._handle.tell()
        self._handle.seek(offset)
        data = self._handle.read(size)
        self._handle.seek(position)
        return data

    def size(self) -> int:
        position = self._handle.tell()
        size = self._handle.seek(0, os.SEEK_END)
        self._handle.seek(position)
        return size

    def digest(self) -> bytes:
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class _HashingWriter:
    """Writes to a binary stream, hashing (sha256 unless told) and counting every byte."""

    def __init__(self, handle: BinaryIO, sha: _Hash | None = None) -> None:
        self._handle = handle
        self.count = 0
        self._sha = hashlib.sha256() if sha is None else sha

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        self._sha.update(data)
        self._handle.write(data)
        self.count += memoryview(data).nbytes

    def digest(self) -> bytes:
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class _BackgroundSha256:
    """sha256 fed in order on a thread of its own, overlapping reading, coding and writing.

    At most a few updates (and the buffers they hold) wait at any time.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._sha = hashlib.sha256()
        self._pool = pool
        self._pending: deque[Future[None]] = deque()

    def update(self, data: bytes | memoryview | np.ndarray, /) -> None:
        self._pending.append(self._pool.submit(self._sha.update, data))
        while len(self._pending) > 4:
            self._pending.popleft().result()

    def digest(self) -> bytes:
        while self._pending:
            self._pending.popleft().result()
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


@contextmanager
def _sha256_pair(threads: int) -> Iterator[tuple[_Hash, _Hash]]:
    """Two sha256 (raw and stored bytes): on two threads of their own unless threads == 1."""
    if threads == 1:
        yield hashlib.sha256(), hashlib.sha256()
        return
    with (
        ThreadPoolExecutor(1, thread_name_prefix="shardprep-sha") as first,
        ThreadPoolExecutor(1, thread_name_prefix="shardprep-sha") as second,
    ):
        yield _BackgroundSha256(first), _BackgroundSha256(second)


class _NoHash:
    """For benchmarks of the codec alone: hashes nothing, digests to 32 zero bytes."""

    def update(self, data: object, /) -> None:
        pass

    def digest(self) -> bytes:
        return bytes(32)

    def hexdigest(self) -> str:
        return "0" * 64


# ---------------------------------------------------------------------------- codecs


@register_codec("none")
class _IdentityCodec:
    """The file as it is."""

    name = "none"
    magic = b""

    def compress(
        self, src: _HashingReader, dst: _HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        _copy(src, dst)

    def decompress(self, src: _HashingReader, dst: _HashingWriter, *, threads: int) -> bytes | None:
        _copy(src, dst)
        return None


def _copy(src: _HashingReader, dst: _HashingWriter) -> None:
    while data := src.read(_IO_CHUNK):
        dst.write(data)


@register_codec("zstd")
class _ZstdCodec:
    """The framed, byte-grouped zstd container described in the module docstring."""

    name = "zstd"
    magic = MAGIC

    def compress(
        self, src: _HashingReader, dst: _HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        raw_size = src.size()
        regions = _regions(src, raw_size)
        dst.write(_FILE_HEADER.pack(MAGIC, VERSION, 0, frame_size, raw_size))
        starts = range(0, raw_size, frame_size)
        frames = (
            (src.read_exact(min(frame_size, raw_size - start), "the source"), start)
            for start in starts
        )

        def encode(item: tuple[bytes, int]) -> list[_Plane]:
            raw, start = item
            return _encode_frame(raw, _plan_segments(regions, start, len(raw)))

        for parts in _ordered_map(encode, frames, threads):
            for part in parts:
                dst.write(part)
        if src.read(1):
            raise CorruptFileError(f"{src.name} grew while it was being compressed")
        dst.write(_TRAILER.pack(_TRAILER_MAGIC, len(starts), raw_size, src.digest()))

    def decompress(self, src: _HashingReader, dst: _HashingWriter, *, threads: int) -> bytes | None:
        header = src.read_exact(_FILE_HEADER.size, "the file header")
        _magic, version, _flags, frame_size, raw_size = _FILE_HEADER.unpack(header)
        if version != VERSION:
            raise CorruptFileError(f"container version {version}, this shardprep reads {VERSION}")
        if not MIN_FRAME_SIZE <= frame_size <= MAX_FRAME_SIZE:
            raise CorruptFileError(f"frame size {frame_size} is out of range")
        reader = _FrameReader(src, frame_size)
        written = 0
        for raw in _ordered_map(_decode_frame, reader, threads):
            dst.write(raw)
            written += raw.nbytes
        n_frames, size, sha = reader.trailer
        if n_frames != reader.count or size != raw_size or written != raw_size:
            raise CorruptFileError(
                f"the trailer promises {n_frames} frames and {size} bytes, the file header "
                f"{raw_size} bytes; found {reader.count} frames holding {written} bytes"
            )
        if src.read(1):
            raise CorruptFileError("there are bytes after the trailer")
        return sha


# ---------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Region:
    """File bytes [start, end) of one tensor, and how its dtype is coded."""

    start: int
    end: int
    kind: int
    item: int


@dataclass(frozen=True)
class _Segment:
    """Bytes [start, start + length) of a frame, to be coded as `kind`."""

    kind: int
    item: int
    start: int
    length: int


def _regions(src: _HashingReader, size: int) -> list[_Region]:
    """The typed byte ranges of a safetensors file, from its header (read aside, unhashed)."""
    header_len, header = _read_safetensors_header(src, size)
    data_start = 8 + header_len
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end, dtype = _entry_span(key, entry, size - data_start, src.name)
        if end > begin:
            kind, item = _DTYPE_KINDS.get(dtype, (_LZ_BYTES, 1))
            spans.append(_Region(data_start + begin, data_start + end, kind, item))
    # Tensors stay apart even when contiguous: each gets its own exponent window.
    spans.sort(key=lambda r: r.start)
    for before, after in itertools.pairwise(spans):
        if after.start < before.end:
            raise CorruptFileError(f"{src.name}: tensors overlap at byte {after.start}")
    return spans


def _read_safetensors_header(src: _HashingReader, size: int) -> tuple[int, dict]:
    name = src.name
    if size < 8:
        raise CorruptFileError(f"{name} is not a safetensors file: it has only {size} bytes")
    (header_len,) = struct.unpack("<Q", src.read_at(8, 0))
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise CorruptFileError(
            f"{name} is not a safetensors file: its header length {header_len} is over "
            f"the limit ({MAX_HEADER_BYTES}) or the file size ({size})"
        )
    raw = src.read_at(header_len, 8)
    if len(raw) != header_len:
        raise CorruptFileError(f"{name}: the safetensors header is truncated")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFileError(f"{name}: the safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptFileError(f"{name}: the safetensors header is not a JSON object")
    return header_len, header


def _entry_span(key: str, entry: object, data_len: int, name: str) -> tuple[int, int, str]:
    try:
        dtype = entry["dtype"]  # type: ignore[index]
        begin, end = entry["data_offsets"]  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise CorruptFileError(f"{name}: tensor {key!r} has no dtype or data_offsets") from None
    if not (isinstance(dtype, str) and isinstance(begin, int) and isinstance(end, int)):
        raise CorruptFileError(f"{name}: tensor {key!r} has a malformed entry")
    if not 0 <= begin <= end <= data_len:
        raise CorruptFileError(
            f"{name}: tensor {key!r} has data_offsets [{begin}, {end}] outside the "
            f"{data_len} data bytes"
        )
    return begin, end, dtype


def _plan_segments(regions: list[_Region], start: int, length: int) -> list[_Segment]:
    """Cut file bytes [start, start + length) into segments (offsets relative to `start`)."""
    segments: list[_Segment] = []
    pos = 0
    first = max(0, bisect.bisect_right(regions, start, key=lambda r: r.start) - 1)
    for region in regions[first:]:
        lo, hi = max(region.start, start) - start, min(region.end, start + length) - start
        if lo >= length:
            break
        if lo >= hi:
            continue
        lo = min(hi, lo + -(lo + start - region.start) % region.item)  # skip a cut element
        step = 32 * region.item  # see _pack6 and _lanes
        body = max(0, (hi - lo) // step * step)
        _add(segments, _Segment(_PLAIN, 1, pos, lo - pos))
        kind = region.kind if body >= _MIN_SEGMENT_BYTES else _PLAIN
        _add(segments, _Segment(kind, region.item, lo, body))
        pos = lo + body
    _add(segments, _Segment(_PLAIN, 1, pos, length - pos))
    return segments


def _add(segments: list[_Segment], segment: _Segment) -> None:
    if segment.length <= 0:
        return
    last = segments[-1] if segments else None
    if last and last.kind == _PLAIN and segment.kind == _PLAIN:
        segments[-1] = _Segment(_PLAIN, 1, last.start, last.length + segment.length)
    else:
        segments.append(segment)


# ---------------------------------------------------------------------------- frames

_Plane = bytes | memoryview | np.ndarray


def _encode_frame(raw: bytes, segments: list[_Segment]) -> list[_Plane]:
    """One self-contained frame, in parts: header, segment and stream tables, streams."""
    view = memoryview(raw)
    plain: list[memoryview] = []
    table: list[bytes] = []
    streams: list[tuple[int, int, _Plane]] = []
    for seg in segments:
        data = view[seg.start : seg.start + seg.length]
        if seg.kind == _PLAIN:
            plain.append(data)
            table.append(_SEGMENT.pack(_PLAIN, 0, 0, seg.length))
            continue
        kind, param, planes, lz = _ENCODERS[seg.kind](data, seg.item)
        table.append(_SEGMENT.pack(kind, param, 0, seg.length))
        streams.extend(_pack(plane, lz) for plane in planes)
    streams.insert(0, _pack(b"".join(plain), lz=True))
    parts: list[_Plane] = [_FRAME_HEADER.pack(_FRAME_MAGIC, len(raw), len(table), len(streams))]
    parts += table
    parts += [
        _STREAM.pack(method, size, memoryview(stored).nbytes) for method, size, stored in streams
    ]
    parts += [stored for _, _, stored in streams]
    return parts


def _pack(plane: _Plane, lz: bool) -> tuple[int, int, _Plane]:
    """(method, raw length, stored bytes): zstd where it pays, else the plane itself."""
    size = memoryview(plane).nbytes
    if size == 0:
        return _RAW, 0, b""
    packed = _zstd_compressor(lz).compress(plane)
    if len(packed) <= size * _PAYS:
        return _ZSTD, size, packed
    return _RAW, size, plane


@dataclass(frozen=True)
class _Frame:
    """A frame as read from the file: its tables, checked, and its stream bytes."""

    index: int
    raw_len: int
    segments: list[tuple[int, int, int]]  # (kind, param, raw_len)
    streams: list[tuple[int, int, int]]  # (method, raw_len, stored_len)
    payload: bytes


class _FrameReader:
    """Iterates over the frames of a container; afterwards `trailer` holds the trailer."""

    def __init__(self, src: _HashingReader, frame_size: int) -> None:
        self._src = src
        self._frame_size = frame_size
        self.count = 0
        self.trailer: tuple[int, int, bytes] = (0, 0, b"")

    def __iter__(self) -> Iterator[_Frame]:
        while True:
            head = self._src.read_exact(_FRAME_HEADER.size, f"frame {self.count}")
            if head[:8] == _TRAILER_MAGIC:
                rest = self._src.read_exact(_TRAILER.size - len(head), "the trailer")
                self.trailer = _TRAILER.unpack(head + rest)[1:]
                return
            yield self._read_frame(head)
            self.count += 1

    def _read_frame(self, head: bytes) -> _Frame:
        where = f"frame {self.count}"
        magic, raw_len, n_segments, n_streams = _FRAME_HEADER.unpack(head)
        if magic != _FRAME_MAGIC or not 0 < raw_len <= self._frame_size:
            raise CorruptFileError(f"{where} has a damaged header")
        if n_segments > raw_len // 1024 + 16 or n_streams > 8 * n_segments + 1:
            raise CorruptFileError(f"{where} claims {n_segments} segments, {n_streams} streams")
        tables = self._src.read_exact(n_segments * _SEGMENT.size + n_streams * _STREAM.size, where)
        cut = n_segments * _SEGMENT.size
        segments = [(k, p, n) for k, p, _, n in _SEGMENT.iter_unpack(tables[:cut])]
        streams = list(_STREAM.iter_unpack(tables[cut:]))
        _check_tables(where, raw_len, segments, streams)
        payload = self._src.read_exact(sum(stored for _, _, stored in streams), where)
        return _Frame(self.count, raw_len, segments, streams, payload)


def _check_tables(
    where: str,
    raw_len: int,
    segments: list[tuple[int, int, int]],
    streams: list[tuple[int, int, int]],
) -> None:
    """Every size a decoder will trust, checked before anything is allocated."""
    if sum(n for _, _, n in segments) != raw_len:
        raise CorruptFileError(f"{where}: its segments do not add up to its {raw_len} bytes")
    expected = [sum(n for kind, _, n in segments if kind == _PLAIN)]
    for kind, param, n in segments:
        if kind != _PLAIN:
            expected += _plane_sizes(where, kind, param, n)
    if len(expected) != len(streams):
        raise CorruptFileError(f"{where}: {len(streams)} streams, {len(expected)} expected")
    for i, ((method, size, stored), want) in enumerate(zip(streams, expected, strict=True)):
        bad_size = size != want if want >= 0 else size > -want or size % 5
        bad_stored = stored > size or (method == _RAW and stored != size) or method > _ZSTD
        if bad_size or bad_stored:
            raise CorruptFileError(f"{where}: stream {i} has inconsistent sizes")


def _plane_sizes(where: str, kind: int, param: int, n: int) -> list[int]:
    """Expected raw size of each stream of a segment; -k means 'escapes, at most k bytes'."""
    item = {_BF16: 2, _F16: 2, _F32: 4, _PLANES: param}.get(kind, 0)
    windowed = kind in (_BF16, _F32)
    if item == 0 or item > 8 or n % (32 * item) or (windowed and param > 192):
        raise CorruptFileError(f"{where}: a segment of kind {kind} is malformed")
    count = n // item
    escapes = -5 * count
    return {
        _BF16: [count, count // 4 * 3, escapes],
        _F16: [count, count],
        _F32: [count, count // 4 * 3, escapes, count, count],
        _PLANES: [count] * item,
    }[kind]


def _decode_frame(frame: _Frame) -> np.ndarray:
    """The raw bytes of one frame."""
    out = np.empty(frame.raw_len, np.uint8)
    streams = _unpack_streams(frame)
    plain, plain_pos, next_stream, pos = streams[0], 0, 1, 0
    for kind, param, n in frame.segments:
        dest = out[pos : pos + n]
        if kind == _PLAIN:
            dest[:] = plain[plain_pos : plain_pos + n]
            plain_pos += n
        else:
            count = len(_plane_sizes("", kind, param, n))
            _DECODERS[kind](dest, param, streams[next_stream : next_stream + count])
            next_stream += count
        pos += n
    return out


def _unpack_streams(frame: _Frame) -> list[np.ndarray]:
    view = memoryview(frame.payload)
    planes, pos = [], 0
    for i, (method, size, stored) in enumerate(frame.streams):
        data = view[pos : pos + stored]
        pos += stored
        if method == _ZSTD:
            try:
                # Checked first, so a damaged size field cannot make zstd allocate it.
                if zstandard.frame_content_size(data) != size:
                    raise zstandard.ZstdError("the zstd frame header gives another size")
                data = _zstd_decompressor().decompress(data)
            except zstandard.ZstdError as exc:
                raise CorruptFileError(f"frame {frame.index}, stream {i}: {exc}") from None
            if len(data) != size:
                raise CorruptFileError(f"frame {frame.index}, stream {i} decompresses short")
        planes.append(np.frombuffer(data, np.uint8))
    return planes


# ---------------------------------------------------------------------------- zstd

_local = threading.local()


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


# ---------------------------------------------------------------------------- transforms
#
# Encoders take a segment's bytes and its item size and return
# (kind, param, planes, lz); decoders fill a segment's bytes from its planes.

_Encoded = tuple[int, int, list[_Plane], bool]


def _encode_planes(data: memoryview, item: int, lz: bool = False) -> _Encoded:
    if item == 1:
        return _PLANES, 1, [data], lz
    grid = np.frombuffer(data, np.uint8).reshape(-1, item)
    return _PLANES, item, [np.ascontiguousarray(grid[:, j]) for j in range(item)], lz


def _encode_lz_bytes(data: memoryview, item: int) -> _Encoded:
    return _encode_planes(data, 1, lz=True)


def _decode_planes(dest: np.ndarray, param: int, planes: list[np.ndarray]) -> None:
    grid = dest.reshape(-1, param)
    for j, plane in enumerate(planes):
        grid[:, j] = plane


def _encode_bf16(data: memoryview, item: int) -> _Encoded:
    words = np.frombuffer(data, "<u2")
    base = _pick_base(words)
    if base is None:
        return _encode_planes(data, 2, lz=True)  # runs of zeros: LZ beats Huffman
    return _BF16, base, list(_split_bf16(words, base)), False


def _decode_bf16(dest: np.ndarray, base: int, planes: list[np.ndarray]) -> None:
    words = dest.view("<u2")
    _join_bf16(words, planes[0], planes[1], base)
    _patch_escapes(words, planes[2])


def _encode_f16(data: memoryview, item: int) -> _Encoded:
    words = np.frombuffer(data, "<u2")
    sym = np.empty(words.size, np.uint8)
    rem = np.empty(words.size, np.uint8)
    for i in range(0, words.size, _CHUNK):
        chunk = words[i : i + _CHUNK]
        np.copyto(sym[i : i + chunk.size], _lanes(chunk, 7, 0xFF), casting="unsafe")
        _remainder(chunk, 7, rem[i : i + chunk.size])
    return _F16, 0, [sym, rem], False


def _decode_f16(dest: np.ndarray, param: int, planes: list[np.ndarray]) -> None:
    out, sym, rem = dest.view("<u2"), planes[0], planes[1]
    wide = np.empty(min(_CHUNK, out.size), np.int16)
    for i in range(0, out.size, _CHUNK):
        part = out[i : i + _CHUNK]
        np.copyto(part, sym[i : i + part.size])
        part *= np.uint16(1 << 7)
        _or_remainder(part, rem[i : i + part.size], 0x7F, wide)


def _encode_f32(data: memoryview, item: int) -> _Encoded:
    high = np.frombuffer(data, "<u2")[1::2].copy()
    base = _pick_base(high)
    if base is None:
        return _encode_planes(data, 4, lz=True)
    grid = np.frombuffer(data, np.uint8).reshape(-1, 4)
    low = [np.ascontiguousarray(grid[:, 1]), np.ascontiguousarray(grid[:, 0])]
    return _F32, base, [*_split_bf16(high, base), *low], False


def _decode_f32(dest: np.ndarray, base: int, planes: list[np.ndarray]) -> None:
    high = np.empty(dest.size // 4, "<u2")
    _join_bf16(high, planes[0], planes[1], base)
    _patch_escapes(high, planes[2])
    # Widen and multiply: numpy does these in SIMD, strided byte stores one at a time.
    out = dest.view("<u4")
    np.copyto(out, high)
    out *= np.uint32(1 << 16)
    low = np.empty(out.size, np.uint32)
    np.copyto(low, planes[3])
    low *= np.uint32(1 << 8)
    out |= low
    np.copyto(low, planes[4])
    out |= low


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


def _split_bf16(words: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symbol, packed remainder and escape planes of bf16 words (a multiple of 32).

    symbol = (exponent - base) << 2 | top 2 mantissa bits, or 252 | those bits (escape);
    remainder = sign and the low 5 mantissa bits, packed by `_pack6`;
    escapes = u32 positions, then u8 exponents, of the elements outside the window.
    """
    n = words.size
    sym = np.empty(n, np.uint8)
    rem = np.empty(n, np.uint8)
    offset = np.uint16(base << 2)
    escapes = []
    for i in range(0, n, _CHUNK):
        chunk = words[i : i + _CHUNK]
        field = _lanes(chunk, 5, 0x3FF)
        field -= offset  # wraps below the window, so one comparison finds both ends
        hit = np.flatnonzero(field >= _ESCAPE)
        if hit.size:
            field[hit] = _ESCAPE | (field[hit] & 3)
            escapes.append(hit + i)
        np.copyto(sym[i : i + chunk.size], field, casting="unsafe")
        _remainder(chunk, 5, rem[i : i + chunk.size])
    where = np.concatenate(escapes) if escapes else np.empty(0, np.int64)
    exponents = ((words[where] >> 7) & 0xFF).astype(np.uint8)
    return sym, _pack6(rem), np.concatenate([where.astype("<u4").view(np.uint8), exponents])


# numpy shifts 8- and 16-bit integers one at a time but 64-bit lanes in bulk, so bit
# fields are cut from whole u64 words, four u16 or eight u8 at a time, and masked per lane.
def _spread(byte_mask: int, width: int) -> np.uint64:
    return np.uint64(int.from_bytes(byte_mask.to_bytes(width, "little") * (8 // width), "little"))


def _lanes(words: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """(words >> shift) & mask for u16 words (a multiple of 4), as a new u16 array."""
    lanes = words.view(np.uint64) >> np.uint64(shift)
    lanes &= _spread(mask, 2)
    return lanes.view(np.uint16)


def _remainder(words: np.ndarray, shift: int, out: np.ndarray) -> None:
    """Sign in bit 7 and the low `shift` bits of each u16 word, as bytes."""
    lanes = words.view(np.uint64)
    low = lanes & _spread((1 << shift) - 1, 2)
    sign = lanes >> np.uint64(8)
    sign &= _spread(0x80, 2)
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
    heads[0] |= (tail << np.uint64(5)) & _spread(0x60, 1)
    heads[1] |= (tail << np.uint64(3)) & _spread(0x60, 1)
    heads[2] |= (tail << np.uint64(1)) & _spread(0x20, 1)
    heads[2] |= (tail >> np.uint64(1)) & _spread(0x40, 1)
    return rem[: 3 * quarter]


def _unpack6_tail(
    packed: np.ndarray, quarter: int, lo: int, hi: int, out: np.ndarray, scratch: np.ndarray
) -> None:
    """Remainder bytes 's00mmmmm' of tail elements lo..hi (multiples of 8), into `out`."""
    heads = [packed[k * quarter + lo : k * quarter + hi].view(np.uint64) for k in range(3)]
    lanes = out.view(np.uint64)
    tmp = scratch[: lanes.size]
    np.right_shift(heads[0], np.uint64(5), out=lanes)
    lanes &= _spread(0x03, 1)
    for source, shift, mask in ((1, 3, 0x0C), (2, 1, 0x10)):
        np.right_shift(heads[source], np.uint64(shift), out=tmp)
        tmp &= _spread(mask, 1)
        lanes |= tmp
    np.left_shift(heads[2], np.uint64(1), out=tmp)
    tmp &= _spread(0x80, 1)
    lanes |= tmp


def _join_bf16(out: np.ndarray, sym: np.ndarray, packed: np.ndarray, base: int) -> None:
    """Inverse of `_split_bf16` without the escapes, in cache-sized chunks."""
    quarter = out.size // 4
    head = 3 * quarter
    offset = np.uint16(base << 7)
    wide = np.empty(min(_CHUNK, out.size), np.int16)
    tail = np.empty(min(_CHUNK, quarter), np.uint8)
    lanes = np.empty(tail.size // 8, np.uint64)
    for i in range(0, out.size, _CHUNK):
        part = out[i : i + _CHUNK]
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


def _or_remainder(out: np.ndarray, rem: np.ndarray, low_mask: int, wide: np.ndarray) -> None:
    """out[:len(rem)] |= sign << 15 | (rem & low_mask), for bytes with the sign in bit 7."""
    tmp = wide[: rem.size]
    np.copyto(tmp, rem.view(np.int8))  # widening an int8 copies the sign into bits 8..15
    tmp &= np.int16(-0x8000 | low_mask)
    out[: rem.size] |= tmp.view(np.uint16)


def _patch_escapes(words: np.ndarray, escapes: np.ndarray) -> None:
    count = escapes.size // 5
    if not count:
        return
    where = escapes[: 4 * count].view("<u4")
    if int(where.max()) >= words.size:
        raise CorruptFileError("an escape points outside its segment")
    words[where] = (words[where] & 0x807F) | (escapes[4 * count :].astype(np.uint16) << 7)


_ENCODERS: dict[int, Callable[[memoryview, int], _Encoded]] = {
    _PLANES: _encode_planes,
    _LZ_BYTES: _encode_lz_bytes,
    _BF16: _encode_bf16,
    _F16: _encode_f16,
    _F32: _encode_f32,
}
_DECODERS: dict[int, Callable[[np.ndarray, int, list[np.ndarray]], None]] = {
    _PLANES: _decode_planes,
    _BF16: _decode_bf16,
    _F16: _decode_f16,
    _F32: _decode_f32,
}


# ---------------------------------------------------------------------------- threads

_T = TypeVar("_T")
_R = TypeVar("_R")


def _ordered_map(fn: Callable[[_T], _R], items: Iterable[_T], threads: int) -> Iterator[_R]:
    """map(fn, items) over `threads` workers, in order, with at most threads + 1 in flight.

    `items` is consumed lazily in the calling thread, so reading stays sequential.
    """
    if threads == 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="shardprep-codec") as pool:
        pending: deque[Future[_R]] = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > threads:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
