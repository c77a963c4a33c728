"""The container: frames cut along the safetensors header, parsed with limits.

All integers little-endian::

    file    = FileHeader Frame* Trailer
    FileHeader (24 B) = b"\\x89SPZ\\r\\n\\x1a\\n" | version u16 (2) | flags u16 (0)
                        | frame_size u32 | raw_size u64
    Frame   = b"SPFR" | raw_len u32 | n_segments u32 | n_streams u32
              | n_segments x Segment | n_streams x Stream | the stored bytes of each stream
    Segment (8 B)  = kind u8 | param u8 | 0 u16 | raw_len u32
    Stream (12 B)  = method u8 (0 raw, 1 zstd frame) | 0 u8 x3 | raw_len u32 | stored_len u32
    Trailer (56 B) = b"SPEND\\0\\0\\0" | n_frames u64 | raw_size u64 | sha256 of the raw bytes

Read as a safetensors header length, the magic is far over any limit: the two never mix.
Frame k holds raw bytes [k * frame_size, (k + 1) * frame_size) of the original file and
depends on nothing else, so frames are coded in parallel and the output does not depend
on the number of threads. The safetensors header (the strict parser of `safetensors_io`)
cuts a frame into segments (see `transforms`): stream 0 holds the bytes of the frame's
PLAIN segments, the other streams follow the segments in order.

Every size is checked before anything is allocated or written: frame k must hold exactly
min(frame_size, raw_size - k * frame_size) bytes, so a file never restores more than the
raw_size its header states (and the caller may require that size up front), and each
stream's raw size follows from its segment's kind and length.

Version 2 added an F16 layout (`transforms.F16_SIGNS`) and a BF16 kind with 7-bit
symbols (`transforms.BF16_7`); version 1 files are read as well, and a reader of
version 1 only refuses version 2 files by their version.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from shardprep.codec import transforms as tf
from shardprep.codec.reassembly import frame_decoder
from shardprep.codec.stored import DTYPE_KINDS, LZ_BYTES, PLAIN, RAW, ZSTD, Frame
from shardprep.errors import CorruptFileError
from shardprep.format.headers import Header

DEFAULT_FRAME_SIZE = 2 * 1024**2
MIN_FRAME_SIZE = 4096
MAX_FRAME_SIZE = 256 * 1024**2

MAGIC = b"\x89SPZ\r\n\x1a\n"
VERSION = 2
READS_VERSIONS = (1, 2)
FILE_HEADER = struct.Struct("<8sHHIQ")
_FRAME_MAGIC = b"SPFR"
_FRAME_HEADER = struct.Struct("<4sIII")
_SEGMENT = struct.Struct("<BBHI")
_STREAM = struct.Struct("<B3xII")
_TRAILER_MAGIC = b"SPEND\0\0\0"
TRAILER = struct.Struct("<8sQQ32s")

_MIN_FRAME_BYTES = _FRAME_HEADER.size + _SEGMENT.size + _STREAM.size
_MIN_SEGMENT_BYTES = 4096  # below this the stream overheads outweigh the split


# ---------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Region:
    """File bytes [start, end) of one tensor, and how its dtype is coded."""

    start: int
    end: int
    kind: int
    item: int


@dataclass(frozen=True)
class Segment:
    """Bytes [start, start + length) of a frame, to be coded as `kind`."""

    kind: int
    item: int
    start: int
    length: int


def regions(header: Header) -> list[Region]:
    """The typed byte ranges of a safetensors file (tensors stay apart even when
    contiguous: each gets its own exponent window)."""
    spans = []
    for info in header.tensors.values():
        if info.nbytes:
            kind, item = DTYPE_KINDS.get(info.dtype, (LZ_BYTES, 1))
            spans.append(Region(info.offset, info.offset + info.nbytes, kind, item))
    return sorted(spans, key=lambda r: r.start)


def plan_segments(spans: list[Region], start: int, length: int) -> list[Segment]:
    """Cut file bytes [start, start + length) into segments (offsets relative to `start`)."""
    segments: list[Segment] = []
    pos = 0
    first = max(0, bisect.bisect_right(spans, start, key=lambda r: r.start) - 1)
    for region in spans[first:]:
        lo, hi = max(region.start, start) - start, min(region.end, start + length) - start
        if lo >= length:
            break
        if lo >= hi:
            continue
        lo = min(hi, lo + -(lo + start - region.start) % region.item)  # skip a cut element
        step = 32 * region.item  # see transforms._pack6 and transforms._lanes
        body = max(0, (hi - lo) // step * step)
        _add(segments, Segment(PLAIN, 1, pos, lo - pos))
        kind = region.kind if body >= _MIN_SEGMENT_BYTES else PLAIN
        _add(segments, Segment(kind, region.item, lo, body))
        pos = lo + body
    _add(segments, Segment(PLAIN, 1, pos, length - pos))
    return segments


def _add(segments: list[Segment], segment: Segment) -> None:
    if segment.length <= 0:
        return
    last = segments[-1] if segments else None
    if last and last.kind == PLAIN and segment.kind == PLAIN:
        segments[-1] = Segment(PLAIN, 1, last.start, last.length + segment.length)
    else:
        segments.append(segment)


# ---------------------------------------------------------------------------- writing


def file_header(frame_size: int, raw_size: int) -> bytes:
    return FILE_HEADER.pack(MAGIC, VERSION, 0, frame_size, raw_size)


def trailer(n_frames: int, raw_size: int, sha256: bytes) -> bytes:
    return TRAILER.pack(_TRAILER_MAGIC, n_frames, raw_size, sha256)


def encode_frame(raw: bytes, segments: list[Segment]) -> list[tf.Plane]:
    """One self-contained frame, in parts: header, segment and stream tables, streams."""
    view = memoryview(raw)
    plain: list[memoryview] = []
    table: list[bytes] = []
    streams: list[tuple[int, int, tf.Plane]] = []
    for seg in segments:
        data = view[seg.start : seg.start + seg.length]
        if seg.kind == PLAIN:
            plain.append(data)
            table.append(_SEGMENT.pack(PLAIN, 0, 0, seg.length))
            continue
        kind, param, planes, lz = tf.ENCODERS[seg.kind](data, seg.item)
        table.append(_SEGMENT.pack(kind, param, 0, seg.length))
        streams.extend(tf.pack(plane, lz) for plane in planes)
    streams.insert(0, tf.pack(b"".join(plain), lz=True))
    parts: list[tf.Plane] = [_FRAME_HEADER.pack(_FRAME_MAGIC, len(raw), len(table), len(streams))]
    parts += table
    parts += [
        _STREAM.pack(method, size, memoryview(stored).nbytes) for method, size, stored in streams
    ]
    parts += [stored for _, _, stored in streams]
    return parts


# ---------------------------------------------------------------------------- reading


class Container:
    """A stored container, walked frame by frame through `read(n)` (up to n bytes, from a
    file or a buffer in memory).

    The file header is checked on construction: magic, version, frame size, that the
    frames it implies fit in `stored_size` (when known) and, when the caller knows it
    (`expected_raw_size`, from the manifest), the size it restores to.
    Iterating yields the frames, each checked against the size it must restore; `finish()`
    then checks the trailer and the end of the file and returns the sha256 it records.
    """

    def __init__(
        self,
        read: Callable[[int], bytes | memoryview],
        expected_raw_size: int | None = None,
        stored_size: int | None = None,
    ) -> None:
        self._read = read
        self._count = 0
        self._stop: bytes | None = None  # the trailer's first bytes, once reached
        head = self._take(FILE_HEADER.size, "the file header")
        magic, version, _flags, self.frame_size, self.raw_size = FILE_HEADER.unpack(head)
        if magic != MAGIC:
            raise CorruptFileError("it does not start with the container's magic bytes")
        if version not in READS_VERSIONS:
            raise CorruptFileError(
                f"container version {version}; this shardprep reads versions "
                f"{', '.join(map(str, READS_VERSIONS))}: upgrade shardprep"
            )
        if not MIN_FRAME_SIZE <= self.frame_size <= MAX_FRAME_SIZE:
            raise CorruptFileError(f"frame size {self.frame_size} is out of range")
        if expected_raw_size is not None and self.raw_size != expected_raw_size:
            raise CorruptFileError(
                f"its header says it restores {self.raw_size:,} bytes where "
                f"{expected_raw_size:,} are expected"
            )
        self.n_frames = -(-self.raw_size // self.frame_size)
        least = FILE_HEADER.size + self.n_frames * _MIN_FRAME_BYTES + TRAILER.size
        if stored_size is not None and least > stored_size:
            raise CorruptFileError(
                f"its header says it restores {self.raw_size:,} bytes in {self.n_frames:,} "
                f"frames, more than its {stored_size:,} bytes can hold"
            )

    def _take(self, size: int, what: str) -> bytes | memoryview:
        piece = self._read(size)
        if len(piece) != size:
            raise CorruptFileError(f"truncated: {what} ends after {len(piece)} of {size} bytes")
        return piece

    def __iter__(self) -> Iterator[Frame]:
        while self._stop is None:
            head = bytes(self._take(_FRAME_HEADER.size, f"frame {self._count}"))
            if head[:8] == _TRAILER_MAGIC:
                self._stop = head
                return
            yield self._read_frame(head)
            self._count += 1

    def _read_frame(self, head: bytes) -> Frame:
        index, where = self._count, f"frame {self._count}"
        magic, raw_len, n_segments, n_streams = _FRAME_HEADER.unpack(head)
        if magic != _FRAME_MAGIC:
            raise CorruptFileError(f"{where} has a damaged header")
        start = index * self.frame_size
        due = min(self.frame_size, self.raw_size - start)
        if index >= self.n_frames or raw_len != due:
            # Refused before a byte of it is decoded: the output never outgrows raw_size.
            raise CorruptFileError(
                f"{where} would restore {raw_len:,} bytes at offset {start:,} of a file its "
                f"header says holds {self.raw_size:,}"
            )
        if n_segments > raw_len // 1024 + 16 or n_streams > 8 * n_segments + 1:
            raise CorruptFileError(f"{where} claims {n_segments} segments, {n_streams} streams")
        tables = self._take(n_segments * _SEGMENT.size + n_streams * _STREAM.size, where)
        cut = n_segments * _SEGMENT.size
        segments = [(k, p, n) for k, p, _, n in _SEGMENT.iter_unpack(tables[:cut])]
        streams = list(_STREAM.iter_unpack(tables[cut:]))
        _check_tables(where, raw_len, segments, streams)
        payload = self._take(sum(stored for _, _, stored in streams), where)
        return Frame(index, start, raw_len, segments, streams, memoryview(payload))

    def finish(self) -> bytes:
        """Check the trailer (after the last frame) and return the sha256 it records."""
        if self._stop is None:
            raise CorruptFileError("the frames were not all read")
        rest = self._take(TRAILER.size - len(self._stop), "the trailer")
        _magic, n_frames, size, sha = TRAILER.unpack(self._stop + bytes(rest))
        if (n_frames, size) != (self.n_frames, self.raw_size) or self._count != self.n_frames:
            raise CorruptFileError(
                f"the trailer promises {n_frames} frames and {size:,} bytes, the file header "
                f"{self.raw_size:,} bytes; found {self._count} frames"
            )
        if len(self._read(1)):
            raise CorruptFileError("there are bytes after the trailer")
        return sha


def _check_tables(
    where: str,
    raw_len: int,
    segments: list[tuple[int, int, int]],
    streams: list[tuple[int, int, int]],
) -> None:
    """Every size a decoder will trust, checked before anything is allocated."""
    if sum(n for _, _, n in segments) != raw_len:
        raise CorruptFileError(f"{where}: its segments do not add up to its {raw_len} bytes")
    expected = [sum(n for kind, _, n in segments if kind == PLAIN)]
    for kind, param, n in segments:
        if kind != PLAIN:
            sizes = tf.plane_sizes(kind, param, n)
            if sizes is None:
                raise CorruptFileError(f"{where}: a segment of kind {kind} is malformed")
            expected += sizes
    if len(expected) != len(streams):
        raise CorruptFileError(f"{where}: {len(streams)} streams, {len(expected)} expected")
    for i, ((method, size, stored), want) in enumerate(zip(streams, expected, strict=True)):
        bad_size = size != want if want >= 0 else size > -want or size % 5
        bad_stored = stored > size or (method == RAW and stored != size) or method > ZSTD
        if bad_size or bad_stored:
            raise CorruptFileError(f"{where}: stream {i} has inconsistent sizes")


def decode_frame(frame: Frame, out: np.ndarray) -> None:
    """Restore one frame into `out` (exactly `frame.raw_len` bytes, u8): in one compiled
    call where `frame_decoder` has one, else (and to say what is wrong when that call
    refuses the frame) stream by stream through `transforms`."""
    native = frame_decoder()
    if native is not None and native(frame, out):
        return
    planes, pos = [], 0
    for i, (method, size, stored) in enumerate(frame.streams):
        data = frame.payload[pos : pos + stored]
        pos += stored
        planes.append(tf.unpack(method, data, size, f"frame {frame.index}, stream {i}"))
    plain, plain_pos, next_stream, pos = planes[0], 0, 1, 0
    for kind, param, n in frame.segments:
        dest = out[pos : pos + n]
        if kind == PLAIN:
            dest[:] = plain[plain_pos : plain_pos + n]
            plain_pos += n
        else:
            count = len(tf.plane_sizes(kind, param, n) or ())
            tf.DECODERS[kind](dest, param, planes[next_stream : next_stream + count])
            next_stream += count
        pos += n
