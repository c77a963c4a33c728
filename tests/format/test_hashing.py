"""sha256 through a reused buffer: the same digest as hashlib over the same bytes."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardprep.hashing import HASH_BUFFER, READ_AHEAD, sha256_file, update_from_file

SIZES = [0, 1, HASH_BUFFER - 1, HASH_BUFFER, HASH_BUFFER + 1, 3 * HASH_BUFFER + 12345]


@pytest.mark.parametrize("size", SIZES)
def test_sha256_file_matches_hashlib(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    ("start", "end"),
    [(0, 0), (5, 6), (7, HASH_BUFFER + 9), (HASH_BUFFER, 2 * HASH_BUFFER), (1, READ_AHEAD + 3)],
)
def test_ranges_fed_in_pieces_make_one_digest(tmp_path: Path, start: int, end: int) -> None:
    data = os.urandom(READ_AHEAD + 4096)
    path = tmp_path / "blob"
    path.write_bytes(data)
    digest = hashlib.sha256(b"prefix")
    fd = os.open(path, os.O_RDONLY)
    try:
        middle = (start + end) // 2
        update_from_file(digest, fd, start, middle, ahead=True)
        update_from_file(digest, fd, middle, end)
    finally:
        os.close(fd)
    assert digest.hexdigest() == hashlib.sha256(b"prefix" + data[start:end]).hexdigest()


def test_threads_hash_different_files_at_once(tmp_path: Path) -> None:
    blobs = {tmp_path / f"blob{i}": os.urandom(2 * HASH_BUFFER + 1000 * i) for i in range(6)}
    for path, data in blobs.items():
        path.write_bytes(data)
    with ThreadPoolExecutor(3) as pool:
        found = dict(zip(blobs, pool.map(sha256_file, blobs), strict=True))
    assert found == {path: hashlib.sha256(data).hexdigest() for path, data in blobs.items()}


def test_a_file_shorter_than_the_range_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="file ended at byte 100, before byte 200"):
            update_from_file(hashlib.sha256(), fd, 0, 200)
    finally:
        os.close(fd)
