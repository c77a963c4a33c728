"""Writes reach the file whole, in pieces of at most WRITE_PIECE bytes per call (larger
single writes were measured to cost far more kernel time on a virtual machine that hands
free memory back to its host: docs/benchmarks-history.md, "Writes of at most
256 KiB")."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np
import pytest

from shardprep.codec.streams import HashingWriter
from shardprep.pieces import WRITE_PIECE, pwrite_all


class _Recorder(io.BytesIO):
    """A binary file in memory that remembers the size of every write call."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, data: memoryview) -> int:
        self.sizes.append(data.nbytes)
        return super().write(data)


def test_a_large_block_is_written_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        sizes.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = os.urandom(2 * WRITE_PIECE + 7)
    fd = os.open(tmp_path / "rank", os.O_RDWR | os.O_CREAT)
    try:
        pwrite_all(fd, data, 3)
    finally:
        os.close(fd)
    assert sizes == [WRITE_PIECE, WRITE_PIECE, 7]
    assert (tmp_path / "rank").read_bytes() == bytes(3) + data


def test_a_short_write_is_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        return real_pwrite(fd, data[:1000], offset)  # the kernel may write less than asked

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = os.urandom(WRITE_PIECE + 2500)
    fd = os.open(tmp_path / "rank", os.O_RDWR | os.O_CREAT)
    try:
        pwrite_all(fd, data, 0)
    finally:
        os.close(fd)
    assert (tmp_path / "rank").read_bytes() == data


def test_a_decoded_frame_reaches_its_file_in_pieces() -> None:
    frame = np.random.default_rng(0).integers(0, 256, 2 * WRITE_PIECE + 7, np.uint8)
    out = _Recorder()
    writer = HashingWriter(out)
    writer.write(frame[:5])
    writer.write(frame[5:])
    assert out.sizes == [5, WRITE_PIECE, WRITE_PIECE, 2]
    assert out.getvalue() == frame.tobytes()
    assert writer.count == frame.nbytes
    assert writer.hexdigest() == hashlib.sha256(frame.tobytes()).hexdigest()
