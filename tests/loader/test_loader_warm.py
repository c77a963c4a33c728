"""The read path by what the page cache holds, on real files and the real page cache: a
file it holds is read with one `pread` per tensor and never asked for page by page; a
file it holds in part is read from there up to the first byte it lacks, the rest in
chunks; a file it lacks goes through the chunks from its first byte. Every byte exact."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shardprep.format.headers import Header, read_header
from shardprep.loader import cpu_read

PAGE = mmap.PAGESIZE
KIB = 1024

pytestmark = pytest.mark.skipif(
    not hasattr(os, "RWF_NOWAIT") or not hasattr(os, "posix_fadvise"),
    reason="reads that stop short of the disk (RWF_NOWAIT) are Linux only",
)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """Eight tensors of 256 KiB to 1 MiB, several dtypes, on disk (not only in cache)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{i}.weight": torch.randint(0, 255, (size * KIB,), generator=generator)
        .to(torch.uint8)
        .view(dtype)
        for i, (size, dtype) in enumerate(
            [(256, torch.bfloat16), (1024, torch.float32), (512, torch.uint8)] * 2
            + [(768, torch.float16), (256, torch.bfloat16)]
        )
    }
    path = tmp_path / "part.safetensors"
    save_file(tensors, path)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())  # clean pages, which the page cache may drop
    return path


@contextlib.contextmanager
def held(path: Path, end: int) -> Iterator[None]:
    """Keep the file's pages before `end` in the page cache (mapped shared, locked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)  # fmt: skip
    libc.mlock.argtypes = libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        pytest.skip(f"cannot map {path}: errno {ctypes.get_errno()}")
    try:
        if libc.mlock(address, end) != 0:
            pytest.skip(f"cannot lock pages in memory here: errno {ctypes.get_errno()}")
        yield
    finally:
        libc.munmap(address, size)


def drop(path: Path) -> None:
    """Ask the page cache to let go of the file's pages that are not locked."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_from(path: Path, offset: int, length: int) -> int:
    """How many bytes from `offset` on the page cache holds, by `mincore`."""
    fd = os.open(path, os.O_RDONLY)
    residency = cpu_read._Residency.of(fd, os.fstat(fd).st_size)
    try:
        return cpu_read._resident_prefix(residency, offset, length)
    finally:
        if residency is not None:
            residency.close()
        os.close(fd)


def data_span(header: Header) -> tuple[int, int]:
    infos = header.tensors.values()
    return min(i.offset for i in infos), max(i.offset + i.nbytes for i in infos)


@pytest.fixture
def chunk_starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets from which the chunked path was started, in order."""
    starts: list[int] = []

    class Recorded(cpu_read._Chunks):
        def __init__(self, path: Path, start: int, end: int) -> None:
            starts.append(start)
            super().__init__(path, start, end)

    monkeypatch.setattr(cpu_read, "_Chunks", Recorded)
    return starts


@pytest.fixture
def whole_file_asks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each time the page cache was asked about a whole file's rest, page by page."""
    asked: list[tuple[int, int]] = []
    real = cpu_read._all_cached

    def recorded(path: Path, start: int, end: int) -> bool:
        asked.append((start, end))
        return real(path, start, end)

    monkeypatch.setattr(cpu_read, "_all_cached", recorded)
    return asked


def read_all(path: Path, header: Header) -> dict[str, torch.Tensor]:
    """`read_into` a fresh destination per tensor; each is filled and yielded itself."""
    dtypes = cpu_read.torch_dtypes(torch)
    places = {
        name: torch.full(info.shape, 7, dtype=dtypes[info.dtype])
        for name, info in header.tensors.items()
    }
    got = dict(cpu_read.read_into(path, header, lambda name, _: places[name]))
    assert all(got[name] is places[name] for name in places)
    return got


def assert_exact(path: Path, got: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    want = load_file(path)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_file_the_page_cache_holds_is_read_without_chunks_or_asking_page_by_page(
    weights: Path, chunk_starts: list[int], whole_file_asks: list
) -> None:
    header = read_header(weights)
    with held(weights, weights.stat().st_size):
        got = read_all(weights, header)
    assert_exact(weights, got)
    assert chunk_starts == []
    assert whole_file_asks == []


def test_a_file_the_page_cache_holds_in_part_is_read_from_there_up_to_its_first_gap(
    weights: Path, chunk_starts: list[int], whole_file_asks: list
) -> None:
    header = read_header(weights)
    start, end = data_span(header)
    half = (start + end) // 2 // PAGE * PAGE
    with held(weights, half):
        drop(weights)
        gap = start + cached_from(weights, start, end - start)
        if gap >= end:
            pytest.skip("the page cache kept the whole file")
        got = read_all(weights, header)
    assert_exact(weights, got)
    assert len(chunk_starts) == 1
    assert half <= chunk_starts[0] <= gap  # pages after `half` may go any time, not before
    assert whole_file_asks == []


def test_a_file_the_page_cache_lacks_goes_through_the_chunks_from_its_first_byte(
    weights: Path, chunk_starts: list[int]
) -> None:
    header = read_header(weights)
    start, _ = data_span(header)
    drop(weights)
    if cached_from(weights, start, 1):
        pytest.skip("the page cache kept the file")
    got = read_all(weights, header)
    assert_exact(weights, got)
    assert chunk_starts == [start]


def test_where_reads_that_stop_short_are_refused_the_file_is_asked_once(
    weights: Path,
    chunk_starts: list[int],
    whole_file_asks: list,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file system without `RWF_NOWAIT` (EOPNOTSUPP): the page cache is asked once about
    the rest of the file, which it holds, and the rest is read with plain reads."""
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list, offset: int, flags: int = 0) -> int:
        if flags & os.RWF_NOWAIT:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(cpu_read.os, "preadv", preadv)
    header = read_header(weights)
    start, end = data_span(header)
    with held(weights, weights.stat().st_size):
        got = read_all(weights, header)
    assert_exact(weights, got)
    assert whole_file_asks == [(start, end)]
    assert chunk_starts == []
