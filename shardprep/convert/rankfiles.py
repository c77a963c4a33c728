"""Rank files being written: created at full size under a temporary name, filled block
by block in any order, hashed as they fill, then renamed into place and journaled.

Each rank file's sha256 is fed from the page cache as soon as a prefix of it is complete
(so hashing overlaps the copy and nothing is read again from disk), on a worker thread
(hashlib releases the GIL); one file's ranges, then its commit, always run in order on
the same thread. A range once hashed is handed to the disk (its writeback starts), so
that the output is on disk soon after the last byte is written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shardprep import safefs
from shardprep.constants import INCOMPLETE_SUFFIX
from shardprep.convert.journal import Journal
from shardprep.format.dtypes import DTYPE_SIZES
from shardprep.format.headers import encode_header, numel
from shardprep.hashing import update_from_file
from shardprep.pieces import pwrite_all
from shardprep.plan.records import FilePlan

if TYPE_CHECKING:
    from shardprep.pieces import Buffer

# A rank file's sha256 is fed in steps of at least this many bytes: small enough that the
# 16-odd files of a conversion do not hold back hundreds of MB complete but not yet hashed.
HASH_STEP = 8 * 1024**2


@dataclass(frozen=True)
class Write:
    """One block of a source tensor going to one place in one rank file."""

    file: int
    row_offset: int  # absolute byte offset of the destination tensor's row 0
    dest_row: int  # first destination row of this block
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    dtype: str
    row_bytes: int  # bytes of one destination row
    repeat: tuple[int, int] = (1, 1)  # source upsampled (rows, columns) before the cut
    # The part of each dim-0 row's [A, B] matrix, written transposed (`Block.matrix`).
    matrix: tuple[tuple[int, int], tuple[int, int]] | None = None
    # The part of each dim-0 row, in a zero-padded matrix (`Block.slab`).
    slab: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None


@dataclass
class OpenFile:
    """A rank file being written, and how far its sha256 has got."""

    plan: FilePlan
    path: Path
    tmp: Path
    fd: int
    size: int
    digest: Any = field(default_factory=hashlib.sha256)
    complete_to: int = 0  # every byte before this offset is written
    submitted_to: int = 0  # every byte before this offset is queued for hashing
    ahead: dict[int, int] = field(default_factory=dict)  # written ranges past complete_to
    finished: bool = False

    def written(self, start: int, end: int) -> None:
        """Record that [start, end) holds its final bytes."""
        if end <= start:
            return
        if start != self.complete_to:
            self.ahead[start] = end
            return
        self.complete_to = end
        while self.complete_to in self.ahead:
            self.complete_to = self.ahead.pop(self.complete_to)


def open_outputs(
    todo: list[FilePlan], out: Path
) -> tuple[list[OpenFile], dict[tuple[str, str], list[Write]]]:
    """Create each rank file at full size (zero padding is never written: it is a hole)
    with its header, and index every block by the source tensor it comes from."""
    files: list[OpenFile] = []
    writes: dict[tuple[str, str], list[Write]] = defaultdict(list)
    for index, file_plan in enumerate(todo):
        header = encode_header([t.spec for t in file_plan.tensors], {"format": "pt"})
        path = out / file_plan.path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + INCOMPLETE_SUFFIX)
        fd = safefs.create_new(tmp, read=True)  # a stale or planted name: removed
        handle = OpenFile(file_plan, path, tmp, fd, len(header) + file_plan.nbytes)
        files.append(handle)
        os.pwrite(fd, header, 0)
        handle.written(0, len(header))
        _preallocate(fd, handle.size)
        offset = len(header)
        for tensor in file_plan.tensors:
            row_bytes = numel(tensor.stacked_shape[1:]) * DTYPE_SIZES[tensor.dtype]
            dest_row = 0
            for block in tensor.blocks:
                rows = block.height
                if block.source is None:
                    start = offset + dest_row * row_bytes
                    handle.written(start, start + rows * row_bytes)
                else:
                    writes[(file_plan.role, block.source)].append(
                        Write(
                            index,
                            offset,
                            dest_row,
                            block.rows,
                            block.cols,
                            tensor.dtype,
                            row_bytes,
                            block.repeat,
                            block.matrix,
                            block.slab,
                        )
                    )
                dest_row += rows
            offset += tensor.spec.nbytes
    return files, writes


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks up front (the scattered writes then fill them in place); where
    the file system cannot, a sparse file of the right size does the same job."""
    os.ftruncate(fd, size)
    with contextlib.suppress(OSError):
        os.posix_fallocate(fd, 0, size)


class Mover:
    """Writes blocks into rank files, and keeps every file's sha256 up with what is
    complete: each file's hashing and commit run, in order, on one worker thread."""

    def __init__(
        self, files: list[OpenFile], journal: Journal, pools: list[ThreadPoolExecutor]
    ) -> None:
        self.files = files
        self.journal = journal
        self.pools = pools
        self.pending: list[Future[None]] = []
        # None until the first kernel copy shows whether this kernel and file system can.
        self.kernel_copy: bool | None = None if hasattr(os, "copy_file_range") else False
        self._scratch = np.empty(0, np.uint8)

    def gathered(self, block: np.ndarray) -> np.ndarray:
        """`block` (strided: columns of rows) copied into one buffer reused from block to
        block, which `write` writes out before it returns: memory the process already
        has, where a new array each time would take new pages from the system."""
        if self._scratch.size < block.nbytes:
            self._scratch = np.empty(block.nbytes, np.uint8)
        out = self._scratch[: block.nbytes].view(block.dtype).reshape(block.shape)
        np.copyto(out, block)
        return out

    def write(self, index: int, data: Buffer, offset: int) -> None:
        pwrite_all(self.files[index].fd, data, offset)
        self.advance(index, offset, offset + len(memoryview(data).cast("B")))

    def copy(self, index: int, src_fd: int, src_offset: int, count: int, offset: int) -> bool:
        """Copy inside the kernel; False where the kernel or file system cannot."""
        if self.kernel_copy is False:
            return False
        dst_fd, done = self.files[index].fd, 0
        while done < count:
            try:
                n = os.copy_file_range(
                    src_fd, dst_fd, count - done, src_offset + done, offset + done
                )
            except OSError as exc:
                unsupported = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
                if self.kernel_copy is None and exc.errno in unsupported:
                    self.kernel_copy = False
                    return False
                raise
            self.kernel_copy = True
            if n == 0:
                raise OSError(f"source file ended early at byte {src_offset + done:,}")
            done += n
        self.advance(index, offset, offset + count)
        return True

    def advance(self, index: int, start: int, end: int) -> None:
        handle = self.files[index]
        handle.written(start, end)
        self._hash_ready(index, handle)

    def catch_up(self) -> None:
        """Queue what opening the files completed (headers, padding; empty files)."""
        for index, handle in enumerate(self.files):
            self._hash_ready(index, handle)

    def _hash_ready(self, index: int, handle: OpenFile) -> None:
        done = handle.complete_to == handle.size
        if handle.finished or (handle.complete_to - handle.submitted_to < HASH_STEP and not done):
            return
        slot = index % len(self.pools)
        start, handle.submitted_to = handle.submitted_to, handle.complete_to
        pool = self.pools[slot]
        if handle.submitted_to > start:
            self.pending.append(pool.submit(_hash_range, handle, start, handle.submitted_to))
        if done:
            handle.finished = True
            self.pending.append(pool.submit(_commit, handle, self.journal))
        self._reap()

    def _reap(self) -> None:
        """Raise a worker's error early; forget finished work."""
        while self.pending and self.pending[0].done():
            self.pending.pop(0).result()

    def wait(self) -> None:
        for future in self.pending:
            future.result()
        self.pending.clear()


def _hash_range(handle: OpenFile, start: int, end: int) -> None:
    """Feed [start, end) of a rank file, just written and so in the page cache, to its
    sha256 (bytes in order: ranges of one file are queued in order on one thread)."""
    update_from_file(handle.digest, handle.fd, start, end)
    if hasattr(os, "POSIX_FADV_DONTNEED"):
        # Nothing here reads these bytes again; on Linux this starts writing them to
        # disk now, while the rest converts, instead of all at the end.
        os.posix_fadvise(handle.fd, start, end - start, os.POSIX_FADV_DONTNEED)


def _commit(handle: OpenFile, journal: Journal) -> None:
    """Close the finished file, rename it into place, record its sha256."""
    os.close(handle.fd)
    handle.fd = -1
    os.replace(handle.tmp, handle.path)
    journal.record(handle.plan.path, handle.digest.hexdigest())
