"""Compressing and restoring files and buffers with a registered codec.

Frames default to 2 MiB of raw input: one frame's working set stays in a core's cache,
and a file of a few dozen MB is still cut into enough frames that the threads finish
together (the last frames decide when a small file is done). From a file, at most
``threads + 1`` frames are in flight, each decoded into a buffer that is reused, so
memory stays a few frames whatever the file size. From memory, each frame is decoded
into its place in the output by the calling thread and ``threads - 1`` workers, each
taking the next frame when done with one: no thread waits to be handed work.
Decompression checks every size before allocating or writing (never more than the size
the file header states, nor than the size the caller expects), then the sha256 of the
restored bytes against the trailer, and raises CorruptFileError on a mismatch, a zstd
error, inconsistent tables or truncation.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardprep.codec import container
from shardprep.codec.container import DEFAULT_FRAME_SIZE, MAX_FRAME_SIZE, MIN_FRAME_SIZE
from shardprep.codec.outputs import output_array
from shardprep.codec.registry import detect_codec, get_codec
from shardprep.codec.stored import Frame
from shardprep.codec.streams import (
    HashingReader,
    HashingWriter,
    atomic_output,
    sha256_pair,
    shared_map,
)
from shardprep.errors import ConfigError, CorruptFileError

MAX_DEFAULT_THREADS = 8


@dataclass(frozen=True)
class CodecResult:
    """Sizes and sha256 (hex) of the raw (original) and the stored (compressed) bytes."""

    raw_bytes: int
    stored_bytes: int
    raw_sha256: str
    stored_sha256: str


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
        atomic_output(dst, like=src) as out_file,
        sha256_pair(n_threads) as (raw_sha, stored_sha),
    ):
        reader = HashingReader(raw_file, str(src), raw_sha)
        writer = HashingWriter(out_file, stored_sha)
        impl.compress(src, reader, writer, threads=n_threads, frame_size=frame_size)
        return CodecResult(reader.count, writer.count, reader.hexdigest(), writer.hexdigest())


def decompress_file(
    src: Path, dst: Path, *, threads: int | None = None, expected_bytes: int | None = None
) -> CodecResult:
    """Restore the original file from `src` into `dst`, verifying its recorded sha256.

    The codec is recognised by the file's first bytes; a plain safetensors file is the
    "none" codec and is copied. `expected_bytes` (the manifest's size) is checked before
    anything is written, so a file that claims another size writes nothing. Raises
    CorruptFileError if `src` is damaged, truncated or restores to another size.
    """
    n_threads = _resolve_threads(threads)
    src, dst = Path(src), Path(dst)
    with (
        open(src, "rb") as stored_file,
        atomic_output(dst, like=src) as out_file,
        sha256_pair(n_threads) as (raw_sha, stored_sha),
    ):
        reader = HashingReader(stored_file, str(src), stored_sha)
        writer = HashingWriter(out_file, raw_sha)
        try:
            impl = detect_codec(stored_file.read(8))
            stored_file.seek(0)
            expected = impl.decompress(
                reader,
                writer,
                threads=n_threads,
                expected=expected_bytes,
                stored_size=os.fstat(stored_file.fileno()).st_size,
            )
            if expected is not None and expected != writer.digest():
                raise CorruptFileError("the sha256 of the restored bytes differs from its record")
        except CorruptFileError as exc:
            message = f"Compressed file {src} is corrupt: {exc}. Fetch or compress it again."
            raise CorruptFileError(message, path=str(src)) from None
        return CodecResult(writer.count, reader.count, writer.hexdigest(), reader.hexdigest())


def decompress_buffer(
    data: bytes | memoryview,
    *,
    threads: int | None = None,
    expected_bytes: int | None = None,
    check_sha256: bool = True,
) -> np.ndarray:
    """Restore a zstd container held in memory: each frame is decoded straight into its
    place in the returned u8 array (into the memory of an earlier output that is no longer
    used, when one fits: `outputs`). Raises CorruptFileError as `decompress_file` does;
    `check_sha256=False` skips the final hash (for measuring the codec alone)."""
    view = memoryview(data).cast("B")
    try:
        return _decode_buffer(view, _resolve_threads(threads), expected_bytes, check_sha256)
    except CorruptFileError as exc:
        raise CorruptFileError(f"Compressed data is corrupt: {exc}.") from None


def _decode_buffer(
    view: memoryview, threads: int, expected_bytes: int | None, check_sha256: bool
) -> np.ndarray:
    position = 0

    def read(size: int) -> memoryview:
        nonlocal position
        position += size
        return view[position - size : position]

    box = container.Container(read, expected_bytes, len(view))
    try:
        out = output_array(box.raw_size)  # no page is touched before a frame is written
    except (MemoryError, ValueError):
        raise CorruptFileError(f"it claims {box.raw_size:,} bytes, more than fit") from None

    def decode(frame: Frame) -> None:
        container.decode_frame(frame, out[frame.start : frame.start + frame.raw_len])

    shared_map(decode, box, threads)
    recorded = box.finish()
    if check_sha256 and recorded != hashlib.sha256(out).digest():
        raise CorruptFileError("the sha256 of the restored bytes differs from its record")
    return out


def _resolve_threads(threads: int | None) -> int:
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(cores or 1, MAX_DEFAULT_THREADS))
    if threads < 1:
        raise ConfigError(f"threads={threads}: use 1 or more (or leave it unset).")
    return threads
