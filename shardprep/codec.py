"""Transport compression for safetensors files: a registry of codecs by name.

``"none"`` is the identity (the file itself). ``"zstd"`` is a framed container of zstd
streams in which each float tensor is first split into an entropy-coded symbol stream and
a stream of near-random bits, as ZipNN does, but with the symbol drawn wider.

Container (all integers little-endian)::

    file    = FileHeader Frame* Trailer
    FileHeader (24 B) = b"\\x89SPZ\\r\\n\\x1a\\n" | version u16 (1) | flags u16 (0)
                        | frame_size u32 | raw_size u64
    Frame   = b"SPFR" | raw_len u32 | n_segments u32 | n_streams u32
              | n_segments x Segment | n_streams x Stream | the stored bytes of each stream
    Segment (8 B)  = kind u8 | param u8 | 0 u16 | raw_len u32
    Stream (12 B)  = method u8 (0 raw, 1 zstd frame) | 0 u8 x3 | raw_len u32 | stored_len u32
    Trailer (56 B) = b"SPEND\\0\\0\\0" | n_frames u64 | raw_size u64 | sha256 of the raw bytes

The magic read as a safetensors header length is above any limit, so the two never mix.
Frame k holds raw bytes [k * frame_size, (k + 1) * frame_size) of the original file and
depends on nothing else: frames are compressed and decompressed in parallel, and the
output does not depend on the number of threads. A frame is cut into segments by the
safetensors header (parsed here, header length refused above 100,000,000 bytes); stream 0
of every frame holds the bytes of its PLAIN segments (the header, gaps, tensors under
4 KiB, element bytes cut by a frame edge), zstd level 3. The other streams belong to the
segments in order:

- BF16 (param = base exponent b): per element, the symbol byte is 6 bits of exponent
  offset (exponent - b, the 63 binades [b, b + 62], picked from a sample) and the top 2
  mantissa bits; the remainder byte is sign and the low 5 mantissa bits. Streams: symbols
  and remainders (each zstd in Huffman-only settings), then escapes (u32 positions, then
  u8 exponents) for the rare elements outside the window. Coding the exponent together
  with the top mantissa bits is what takes the ratio past ZipNN's exponent-only Huffman:
  inside a binade the density of a bell-shaped weight distribution is not flat, so those
  bits are not random given the exponent (randn * 0.02: 1.522 against ZipNN's 1.510).
  A segment with more than 1/32 of its elements outside any window (many exact zeros)
  uses PLANES instead.
- F16: symbol = 5 exponent bits and top 3 mantissa bits, remainder = sign and the low 7
  mantissa bits (near random, so usually stored raw).
- F32 (param = base): the high 16 bits of each element as BF16, then the two low bytes as
  two planes.
- PLANES (param = item size): byte plane j holds byte j of every element. F8_E4M3,
  F8_E5M2 and every other dtype use it with item size 1, in the same Huffman-only zstd
  setting that the symbol streams use. Measured on fp8 e4m3 (randn * 0.02 scaled to the
  e4m3 range, and MiniLM weights cast): Huffman-only 1.23x and 1.24x, zstd level 1 1.18x
  and 1.19x, level 3 1.17x and 1.18x, so fp8 is entropy-coded bytes; the sign/exponent
  split gains nothing there because the e4m3 byte is one symbol already.

Every stream is stored raw where zstd would not save 2 %. Huffman-only zstd is zstd's
`fast` strategy with min_match 7 and a 64-entry hash table: it finds almost no matches,
so each 128 KiB block is literals with their own Huffman table.

Frames default to 16 MiB of raw input: below glibc's 32 MiB mmap ceiling, so the per-frame
buffers are recycled instead of faulted in fresh each time. At most ``threads + 1`` frames
are in flight; memory stays a few frames whatever the file size. Decompression checks the
sha256 of the raw bytes against the trailer and raises CorruptFileError on a mismatch, a
zstd error, inconsistent tables or truncation.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

import numpy as np

from shardprep.constants import INCOMPLETE_SUFFIX, MAX_HEADER_BYTES
from shardprep.errors import ConfigError, CorruptFileError

DEFAULT_FRAME_SIZE = 16 * 1024**2
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

_PLAIN, _PLANES, _BF16, _F16, _F32 = range(5)
_KIND_NAMES = {_PLAIN: "plain", _PLANES: "planes", _BF16: "bf16", _F16: "f16", _F32: "f32"}
_RAW, _ZSTD = 0, 1

_MIN_SEGMENT_BYTES = 4096  # below this the stream overheads outweigh the split
_PAYS = 0.98  # keep a zstd stream only if it saves at least 2 %
_CHUNK = 1 << 18  # elements per numpy pass: keeps the temporaries in L2
_WINDOW = 63  # binades covered by a BF16 symbol; symbol 63 << 2 marks an escape
_ESCAPE = _WINDOW << 2
_MAX_ESCAPE_SHARE = 1 / 32
_SAMPLE_STEP = 16

_IO_CHUNK = 16 * 1024**2

# dtype -> (kind, item size). Anything else (F8_*, integers, bool, F64...) is PLANES(1).
_DTYPE_KINDS = {"BF16": (_BF16, 2), "F16": (_F16, 2), "F32": (_F32, 4)}


@dataclass(frozen=True)
class CodecResult:
    """Sizes and sha256 (hex) of the raw (original) and the stored (compressed) bytes."""

    raw_bytes: int
    stored_bytes: int
    raw_sha256: str
    stored_sha256: str


# ---------------------------------------------------------------------------- registry


class Codec(Protocol):
    name: str
    magic: bytes

    def compress(
        self, src: BinaryIO, dst: _HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        """Write the stored form of `src` (already hashed by the caller) to `dst`."""

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

    `threads` defaults to the usable cores (at most 8); `frame_size` is the raw bytes per
    independent frame. The output bytes do not depend on `threads`.
    """
    impl = get_codec(codec)
    n_threads = _resolve_threads(threads)
    if not MIN_FRAME_SIZE <= frame_size <= MAX_FRAME_SIZE:
        raise ConfigError(
            f"frame_size={frame_size} is out of range: use {MIN_FRAME_SIZE} to "
            f"{MAX_FRAME_SIZE} bytes (the default is {DEFAULT_FRAME_SIZE})."
        )
    src, dst = Path(src), Path(dst)
    with open(src, "rb") as raw_file, _atomic_output(dst, like=src) as out_file:
        reader = _HashingReader(raw_file, str(src))
        writer = _HashingWriter(out_file)
        impl.compress(reader, writer, threads=n_threads, frame_size=frame_size)  # type: ignore[arg-type]
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
        with _atomic_output(dst, like=src) as out_file:
            reader = _HashingReader(stored_file, str(src))
            writer = _HashingWriter(out_file)
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
    raise CorruptFileError(
        f"{src} is neither a shardprep-compressed file nor a safetensors file "
        f"(first bytes {head!r}). Fetch it again.",
        path=str(src),
    )


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


class _HashingReader:
    """Reads a file, hashing and counting every byte handed out."""

    def __init__(self, handle: BinaryIO, name: str) -> None:
        self._handle = handle
        self.name = name
        self.count = 0
        self._sha = hashlib.sha256()

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

    def size(self) -> int:
        return os.fstat(self._handle.fileno()).st_size

    def digest(self) -> bytes:
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class _HashingWriter:
    """Writes to a file, hashing and counting every byte."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.count = 0
        self._sha = hashlib.sha256()

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        self._sha.update(data)
        self._handle.write(data)
        self.count += memoryview(data).nbytes

    def digest(self) -> bytes:
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


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
