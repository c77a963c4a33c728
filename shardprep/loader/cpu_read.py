"""The CPU read path of a checked rank file, each tensor copied into its destination.

While the page cache holds a file's bytes, each tensor is read with one `pread` straight
into its destination. From the first byte it does not hold on, a few threads read the
file front to back, `O_DIRECT` where the file system allows, into a few reused staging
buffers while the caller's thread copies each tensor out of them: the disk works on the
next chunks while this one is copied, and a cold read costs one copy and no page-cache
work.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardprep.errors import CorruptFileError
from shardprep.format.dtypes import TORCH_DTYPE_NAMES
from shardprep.format.headers import Header, TensorInfo

if TYPE_CHECKING:
    import torch


def torch_dtypes(torch: Any) -> dict[str, torch.dtype]:
    """safetensors dtype names -> torch dtypes (torch passed in: imported lazily)."""
    return {key: getattr(torch, value) for key, value in TORCH_DTYPE_NAMES.items()}


def read_into(
    path: Path, header: Header, into: Callable[[str, TensorInfo], torch.Tensor | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read each tensor of one checked file, in file order, into its destination.

    While the page cache holds the file's bytes, each tensor is read with one `pread`
    straight into its destination (`_Reads`). From the first byte it does not hold on:

    The file is read front to back in `CHUNK_BYTES` pieces by a thread of its own into a
    few staging buffers that are reused (so their pages are faulted in once), while this
    thread copies each tensor's bytes from them into the destination: the disk works on
    the next chunks while this one is copied. A chunk that is in the page cache is
    copied from there; one that is not is read with `O_DIRECT`, disk to staging buffer,
    so that a cold read costs one copy and no page-cache work (see `_Chunks`)."""
    import torch

    dtypes = torch_dtypes(torch)
    items = sorted(header.tensors.items(), key=lambda item: item[1].offset)
    end = max((info.offset + info.nbytes for _, info in items), default=0)
    with _Reads(path, end) as reads:
        for name, info in items:
            dest = into(name, info)
            if dest is None:
                dest = torch.empty(info.shape, dtype=dtypes[info.dtype])
            if info.nbytes:
                reads.copy_to(dest.reshape(-1).view(torch.uint8), info.offset)
            yield name, dest


class _Reads:
    """The bytes of one file up to `end`, asked for in file order.

    Whether the page cache holds the file is asked once, at the first byte asked for
    (`_starts_cached`: one page, with `mincore`, which reads nothing). If it does, each
    destination is faulted in (`_PREFAULT`) and read with `pread` straight from the page
    cache, with `RWF_NOWAIT`: a read that would wait for the disk stops short instead.
    From the first byte not in the page cache on, the rest of the file goes through
    `_Chunks`. Where `RWF_NOWAIT` is not available, the whole rest of the file is asked
    with `mincore` (`_all_cached`) and read with plain `pread`s if the cache holds it all."""

    def __init__(self, path: Path, end: int) -> None:
        self.path, self.end = path, end
        self.fd = os.open(path, os.O_RDONLY)
        self.cached: bool | None = None  # None until the first byte is asked for
        self.nowait = getattr(os, "RWF_NOWAIT", 0)
        self.chunks: _Chunks | None = None

    def __enter__(self) -> _Reads:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.chunks is not None:
            self.chunks.close()
        os.close(self.fd)

    def copy_to(self, dest: torch.Tensor, offset: int) -> None:
        """Copy the file's bytes [offset, offset + len(dest)) into `dest` (1-D uint8);
        offsets must not go back."""
        if self.cached is None:
            self.cached = _starts_cached(self.path, self.fd, offset)
            if self.cached and not self.nowait:
                self.cached = _all_cached(self.path, offset, self.end)
        done = self._from_cache(dest, offset) if self.chunks is None and self.cached else 0
        if done < dest.numel():
            if self.chunks is None:
                self.chunks = _Chunks(self.path, offset + done, self.end)
            self.chunks.copy_to(dest[done:], offset + done)

    def _from_cache(self, dest: torch.Tensor, offset: int) -> int:
        """Read what the page cache holds of [offset, offset + len(dest)) into `dest`,
        up to the first byte it does not hold; how many bytes were read."""
        view = memoryview(dest.numpy()).cast("B")
        _PREFAULT(dest.data_ptr(), len(view))
        done = 0
        while done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], offset + done, self.nowait)
            except BlockingIOError:  # the next page is not in the page cache
                return done
            except OSError as exc:
                if not self.nowait or exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self.nowait = 0  # refused by this file system: ask the page cache once
                if not _all_cached(self.path, offset + done, self.end):
                    return done
                continue
            if n == 0:
                raise CorruptFileError(
                    f"{self.path} ended early at byte {offset + done:,}", path=str(self.path)
                )
            done += n
        return done


def _starts_cached(path: Path, fd: int, offset: int) -> bool:
    """Whether the page cache holds the file's page at `offset` (a cold file: no)."""
    residency = _Residency.of(fd, os.fstat(fd).st_size)
    try:
        return _resident_prefix(residency, offset, 1) == 1
    finally:
        if residency is not None:
            residency.close()


def _all_cached(path: Path, start: int, end: int) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        residency = _Residency.of(fd, os.fstat(fd).st_size)
        if residency is None:
            return False
        try:
            return _resident_prefix(residency, start, end - start) == end - start
        finally:
            residency.close()
    finally:
        os.close(fd)


class _Prefault:
    """Fault a destination's fresh pages in with one `madvise(MADV_POPULATE_WRITE)` before
    it is read into: a `pread` into untouched memory otherwise takes one page fault per
    page from inside the kernel's copy. Where the kernel lacks it (before Linux 5.14)
    nothing is done, and the faults happen as before."""

    POPULATE_WRITE = 23  # MADV_POPULATE_WRITE, Linux 5.14
    PAGE = mmap.PAGESIZE

    def __init__(self) -> None:
        self.madvise: Any = None  # found on first use; False once refused

    def __call__(self, address: int, length: int) -> None:
        if self.madvise is False:
            return
        if self.madvise is None:
            import ctypes

            self.madvise = ctypes.CDLL(None, use_errno=True).madvise
            self.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        start = -(-address // self.PAGE) * self.PAGE  # the pages wholly inside it
        end = (address + length) // self.PAGE * self.PAGE
        if end > start and self.madvise(start, end - start, self.POPULATE_WRITE) != 0:
            self.madvise = False


_PREFAULT = _Prefault()

CHUNK_BYTES = 16 << 20
"""The size of one read (a multiple of `ALIGN`)."""
STAGING_BUFFERS = 4
"""Chunks in memory at once per file being read, and reads in flight: the copy works on
one while the disk fills the others (so 64 MiB per rank with the default chunk)."""
READ_THREAD = "shardprep-read"
ALIGN = 4096
"""Alignment of `O_DIRECT` offsets, lengths and buffers (a page: above any logical block
size Linux asks for)."""


class _Chunks:
    """The bytes [start, end) of a file, read ahead in aligned chunks by a few threads.

    Up to `STAGING_BUFFERS` chunks are read at once, each by a thread of its own into a
    buffer that is reused for a later chunk once it has been copied from (so its pages
    are faulted in once, and the disk has several reads queued). The part of a chunk
    that the page cache holds (asked with `mincore`, which reads nothing) is read from
    there; the rest, from the first page that is not cached, with `O_DIRECT` straight
    into the buffer, which skips the page cache's allocation and bookkeeping and its
    copy. Where `O_DIRECT` is not available (tmpfs, another OS) or is refused, plain
    reads do the same job. The consumer takes chunks in file order with `copy_to`;
    closing cancels the reads not started and waits for the others."""

    def __init__(self, path: Path, start: int, end: int) -> None:
        import torch

        self.path, self.end = path, end
        base = start - start % ALIGN
        self.offsets = list(range(base, end, CHUNK_BYTES))
        count = min(STAGING_BUFFERS, len(self.offsets))
        self.buffers = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(count)]
        self.views = [torch.frombuffer(b, dtype=torch.uint8) for b in self.buffers]
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd = _open_direct(path)
        self.direct = self.direct_fd is not None
        self.residency = _Residency.of(self.fd, os.fstat(self.fd).st_size)
        self.pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix=READ_THREAD)
        self.pending: deque[tuple[int, int, Future[int]]] = deque()
        self.submitted = 0
        self.current: tuple[int, int, int] | None = None  # (buffer, offset, length)
        for index in range(count):
            self._submit(index)

    def __enter__(self) -> _Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for _, _, future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=True)
        self.pending.clear()
        if self.residency is not None:
            self.residency.close()
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        self.views.clear()
        for buffer in self.buffers:
            with contextlib.suppress(BufferError):  # still viewed (a traceback): left to gc
                buffer.close()

    def _submit(self, index: int) -> None:
        """Read the next chunk not yet asked for into buffer `index`."""
        if self.submitted < len(self.offsets):
            offset = self.offsets[self.submitted]
            self.submitted += 1
            view = memoryview(self.buffers[index])
            self.pending.append((index, offset, self.pool.submit(self._read_chunk, view, offset)))

    def _read_chunk(self, view: memoryview, offset: int) -> int:
        want = min(CHUNK_BYTES, self.end - offset)
        cached = _resident_prefix(self.residency, offset, want)
        done = 0
        while done < cached:  # from the page cache
            n = os.preadv(self.fd, [view[done:cached]], offset + done)
            if n == 0:
                break
            done += n
        while done < want:
            n = self._read_some(view, offset + done, done, want)
            if n == 0:
                raise CorruptFileError(
                    f"{self.path} ended early at byte {offset + done:,}", path=str(self.path)
                )
            done += n
        return want

    def _read_some(self, view: memoryview, at: int, done: int, want: int) -> int:
        if self.direct and self.direct_fd is not None and at % ALIGN == 0:
            # Whole pages up to the chunk's end (which may pass `end`; a read past the
            # end of the file returns short).
            length = -(-(want - done) // ALIGN) * ALIGN
            try:
                n = os.preadv(self.direct_fd, [view[done : done + length]], at)
                return min(n, want - done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # refused here: plain reads from now on
        return os.preadv(self.fd, [view[done:want]], at)

    def copy_to(self, dest: torch.Tensor, offset: int) -> None:
        """Copy the file's bytes [offset, offset + len(dest)) into `dest` (1-D uint8);
        offsets must not go back."""
        done = 0
        while done < dest.numel():
            index, start, length = self._chunk_at(offset + done)
            begin = offset + done - start
            n = min(length - begin, dest.numel() - done)
            dest[done : done + n].copy_(self.views[index][begin : begin + n])
            done += n

    def _chunk_at(self, offset: int) -> tuple[int, int, int]:
        while self.current is None or offset >= self.current[1] + self.current[2]:
            if self.current is not None:
                self._submit(self.current[0])  # its buffer is free for the next chunk
            if not self.pending:
                raise CorruptFileError(f"{self.path} ended early", path=str(self.path))
            index, start, future = self.pending.popleft()
            self.current = (index, start, future.result())
        return self.current


def _open_direct(path: Path) -> int | None:
    """A second descriptor with `O_DIRECT`, where the platform and file system allow."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


def _resident_prefix(residency: _Residency | None, offset: int, length: int) -> int:
    """How many bytes from `offset` on (up to `length`) the page cache holds, in whole
    pages, or `length` if it holds them all; 0 where that cannot be asked."""
    return residency.prefix(offset, length) if residency is not None else 0


class _Residency:
    """Which pages of a file are in the page cache (`mincore` over a mapping that is
    never touched, so asking reads nothing and changes nothing)."""

    def __init__(self, fd: int, size: int) -> None:
        import ctypes

        self.ctypes = ctypes
        self.mincore = ctypes.CDLL(None, use_errno=True).mincore
        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self.anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self.anchor)

    @classmethod
    def of(cls, fd: int, size: int) -> _Residency | None:
        try:
            return cls(fd, size) if size else None
        except (OSError, AttributeError, ValueError, TypeError):
            return None

    def prefix(self, offset: int, length: int) -> int:
        ctypes = self.ctypes
        start = offset - offset % mmap.PAGESIZE
        span = offset + length - start
        pages = (ctypes.c_ubyte * (-(-span // mmap.PAGESIZE)))()
        if self.mincore(ctypes.c_void_p(self.address + start), ctypes.c_size_t(span), pages):
            return 0
        first_missing = bytes(pages).find(b"\x00")  # bit 0 is the only one Linux sets
        if first_missing < 0:
            return length
        return max(0, min(length, start + first_missing * mmap.PAGESIZE - offset))

    def close(self) -> None:
        del self.anchor
        self.map.close()
