"""Rank files being written: a block reaches the file whole, in pieces of at most
WRITE_PIECE bytes per write call (larger single writes were measured to cost far more
kernel time on a page cache filled by large reads: BENCHMARKS.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardprep.convert.rankfiles import WRITE_PIECE, pwrite_all


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
