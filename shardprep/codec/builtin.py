"""The codecs shardprep ships: "none", the file as it is, and "zstd", the framed,
byte-grouped container of `container` and `transforms`."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shardprep.codec import container
from shardprep.codec.registry import register_codec
from shardprep.codec.stored import Frame
from shardprep.codec.streams import (
    MAX_PENDING_UPDATES,
    HashingReader,
    HashingWriter,
    ordered_map,
)
from shardprep.errors import CorruptFileError
from shardprep.format.headers import read_header

_IO_CHUNK = 16 * 1024**2


@register_codec("none")
class _IdentityCodec:
    """The file as it is."""

    name = "none"
    magic = b""

    def compress(
        self, path: Path, src: HashingReader, dst: HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        while data := src.read(_IO_CHUNK):
            dst.write(data)

    def decompress(
        self,
        src: HashingReader,
        dst: HashingWriter,
        *,
        threads: int,
        expected: int | None,
        stored_size: int,
    ) -> bytes | None:
        while data := src.read(_IO_CHUNK):
            if expected is not None and src.count > expected:
                raise CorruptFileError(f"it holds more than the {expected:,} bytes expected")
            dst.write(data)
        if expected is not None and src.count != expected:
            raise CorruptFileError(f"it holds {src.count:,} bytes where {expected:,} are expected")
        return None


@register_codec("zstd")
class _ZstdCodec:
    """The framed, byte-grouped zstd container of `container` and `transforms`."""

    name = "zstd"
    magic = container.MAGIC

    def compress(
        self, path: Path, src: HashingReader, dst: HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        header = read_header(path)
        spans, raw_size = container.regions(header), header.file_size
        dst.write(container.file_header(frame_size, raw_size))
        starts = range(0, raw_size, frame_size)
        frames = (
            (src.read_exact(min(frame_size, raw_size - start), "the source"), start)
            for start in starts
        )

        def encode(item: tuple[bytes, int]) -> list[container.tf.Plane]:
            raw, start = item
            return container.encode_frame(raw, container.plan_segments(spans, start, len(raw)))

        for parts in ordered_map(encode, frames, threads):
            for part in parts:
                dst.write(part)
        if src.read(1):
            raise CorruptFileError(f"{src.name} grew while it was being compressed")
        dst.write(container.trailer(len(starts), raw_size, src.digest()))

    def decompress(
        self,
        src: HashingReader,
        dst: HashingWriter,
        *,
        threads: int,
        expected: int | None,
        stored_size: int,
    ) -> bytes | None:
        box = container.Container(src.read, expected, stored_size)
        # Buffers are reused frame after frame (no fresh pages to fault in), once the
        # sha256 thread can no longer be reading them.
        spare: list[np.ndarray] = []
        written: deque[np.ndarray] = deque()

        def frames() -> Iterator[tuple[Frame, np.ndarray]]:
            for frame in box:
                buffer = spare.pop() if spare else np.empty(box.frame_size, np.uint8)
                yield frame, buffer

        def decode(item: tuple[Frame, np.ndarray]) -> tuple[np.ndarray, int]:
            frame, buffer = item
            container.decode_frame(frame, buffer[: frame.raw_len])
            return buffer, frame.raw_len

        for buffer, size in ordered_map(decode, frames(), threads):
            dst.write(buffer[:size])
            written.append(buffer)
            if len(written) > MAX_PENDING_UPDATES:
                spare.append(written.popleft())
        return box.finish()
