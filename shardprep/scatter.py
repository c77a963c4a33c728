"""Moving the bytes of a plan: every source byte read once, every output byte written once.

Source files are read in order. A tensor whose rank slices are whole rows of the same
dtype goes from file to file inside the kernel (`copy_file_range`), unless its bytes are
needed here anyway to hash the source; other tensors are read in bounded chunks into two
reused buffers and scattered (columns gathered, dtypes cast) to every rank file that
needs them. Each rank file is hashed while it is written: as soon as a prefix of it is
complete, that prefix is read back from the page cache and fed to its sha256 on a worker
thread (hashlib releases the GIL), so hashing overlaps the copy and no file is read
again from disk. A finished file is renamed into place and recorded in the journal.

A source file that lives in the Hugging Face cache is a blob named by its sha256; that
name is recorded as its hash without reading it for that purpose (`rehash_source` hashes
it anyway and fails if it differs).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from shardprep.checkpoint import Checkpoint
from shardprep.constants import CHUNK_BYTES, INCOMPLETE_SUFFIX
from shardprep.errors import CorruptFileError
from shardprep.journal import Journal
from shardprep.plan import FilePlan, Plan
from shardprep.safetensors_io import DTYPE_SIZES, TensorInfo, encode_header, numel

HASH_STEP = 32 * 1024**2  # a rank file's sha256 is fed in steps of this many bytes
OUTPUT_HASHERS = 2  # worker threads hashing rank files (each file always on the same one)


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


def write_rank_files(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    out: Path,
    todo: list[FilePlan],
    journal: Journal,
    *,
    progress: bool,
    rehash_source: bool = False,
) -> dict[tuple[str, str], str]:
    """Write every file of `todo`; returns the sha256 of each source file read whole."""
    files, writes = _open_outputs(todo, out)
    full = plan.stages == tuple(range(plan.topology.pp))
    total = sum(_bytes_to_read(cp, role, writes, full) for role, cp in checkpoints.items())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    hashers = [ThreadPoolExecutor(1) for _ in range(OUTPUT_HASHERS + 1)]
    mover = Mover(files, journal, hashers[1:])
    source_hashes: dict[tuple[str, str], str] = {}
    try:
        mover.catch_up()
        reader = SourceReader(hashers[0])
        for role, checkpoint in checkpoints.items():
            for file in checkpoint.files:
                known = cached_hub_sha256(checkpoint, file) if full else None
                hash_it = full and (known is None or rehash_source)
                digest = _scatter_file(reader, mover, checkpoint, role, file, writes, hash_it, bar)
                if digest and known and digest != known:
                    raise CorruptFileError(
                        f"{checkpoint.root / file} hashes to {digest}, not to the sha256 its "
                        f"Hugging Face cache blob is named by ({known}); the cache is damaged: "
                        "delete it and download the model again",
                        path=str(checkpoint.root / file),
                    )
                if digest or known:
                    source_hashes[(role, file)] = digest or known  # type: ignore[assignment]
        mover.wait()
    except BaseException:
        for pool in hashers:
            pool.shutdown(wait=True, cancel_futures=True)
        for handle in files:
            if handle.fd >= 0:
                os.close(handle.fd)
                handle.fd = -1
            handle.tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        for pool in hashers:
            pool.shutdown(wait=True)
    return source_hashes


def _open_outputs(
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
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        handle = OpenFile(file_plan, path, tmp, fd, len(header) + file_plan.nbytes)
        files.append(handle)
        os.pwrite(fd, header, 0)
        handle.written(0, len(header))
        _preallocate(fd, handle.size)
        offset = len(header)
        for tensor in file_plan.tensors:
            row_bytes = numel(tensor.shape[1:]) * DTYPE_SIZES[tensor.dtype]
            dest_row = 0
            for block in tensor.blocks:
                rows = block.rows[1] - block.rows[0]
                if block.source is None:
                    start = offset + dest_row * row_bytes
                    handle.written(start, start + rows * row_bytes)
                else:
                    writes[(file_plan.role, block.source)].append(
                        Write(
                            index, offset, dest_row, block.rows, block.cols, tensor.dtype, row_bytes
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


def _bytes_to_read(
    checkpoint: Checkpoint, role: str, writes: dict[tuple[str, str], list[Write]], full: bool
) -> int:
    if full:
        return sum((checkpoint.root / f).stat().st_size for f in checkpoint.files)
    return sum(t.info.nbytes for n, t in checkpoint.tensors.items() if (role, n) in writes)


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
        self.buffers = [bytearray(HASH_STEP) for _ in pools]

    def write(self, index: int, data: memoryview | bytes, offset: int) -> None:
        _pwrite_all(self.files[index].fd, data, offset)
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
        pool, buffer = self.pools[slot], self.buffers[slot]
        if handle.submitted_to > start:
            self.pending.append(
                pool.submit(_hash_range, handle, start, handle.submitted_to, buffer)
            )
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


def _hash_range(handle: OpenFile, start: int, end: int, buffer: bytearray) -> None:
    """Feed [start, end) of a rank file, just written and so in the page cache, to its
    sha256 (bytes in order: ranges of one file are queued in order on one thread)."""
    view = memoryview(buffer)
    while start < end:
        piece = view[: min(len(view), end - start)]
        _pread_all(handle.fd, piece, start)
        handle.digest.update(piece)
        start += len(piece)


def _commit(handle: OpenFile, journal: Journal) -> None:
    """Close the finished file, rename it into place, record its sha256."""
    os.close(handle.fd)
    handle.fd = -1
    os.replace(handle.tmp, handle.path)
    journal.record(handle.plan.path, handle.digest.hexdigest())


class SourceReader:
    """Reads source files in order into two reused buffers, so that hashing a chunk (on
    a worker thread) overlaps scattering the next one, and fresh memory is not touched
    over and over."""

    def __init__(self, hasher: ThreadPoolExecutor) -> None:
        self.hasher = hasher
        self.buffers = [memoryview(bytearray(CHUNK_BYTES)) for _ in range(2)]
        self.pending: list[Future[None] | None] = [None, None]
        self.turn = 0

    def _buffer(self, nbytes: int) -> memoryview:
        slot, self.turn = self.turn, self.turn ^ 1
        if self.pending[slot] is not None:
            self.pending[slot].result()  # type: ignore[union-attr]
            self.pending[slot] = None
        if nbytes > len(self.buffers[slot]):
            self.buffers[slot] = memoryview(bytearray(nbytes))
        self.current = slot
        return self.buffers[slot][:nbytes]

    def chunks(
        self, fd: int, info: TensorInfo, digest: Any | None
    ) -> Iterator[tuple[int, memoryview]]:
        """(first row, bytes) of consecutive row ranges of at most CHUNK_BYTES (one row
        at least); each chunk is hashed into `digest` in order, in the background."""
        rows_total = info.shape[0] if info.shape else 1
        rows_per_chunk = max(1, CHUNK_BYTES // max(info.row_bytes, 1))
        for start in range(0, rows_total, rows_per_chunk):
            end = min(rows_total, start + rows_per_chunk)
            view = self._buffer((end - start) * info.row_bytes)
            offset = info.offset + start * info.row_bytes
            _pread_all(fd, view, offset)
            # Let the disk fetch the next chunk while this one is hashed and scattered.
            _advise(fd, offset + len(view), CHUNK_BYTES, "POSIX_FADV_WILLNEED")
            if digest is not None:
                self.pending[self.current] = self.hasher.submit(digest.update, view)
            yield start, view

    def hash_bytes(self, digest: Any, data: bytes) -> None:
        self.hasher.submit(digest.update, data)

    def hexdigest(self, digest: Any) -> str:
        return self.hasher.submit(digest.hexdigest).result()


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    if hasattr(os, advice):
        os.posix_fadvise(fd, offset, length, getattr(os, advice))


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"file ended early at byte {offset + done:,}")
        done += n


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _scatter_file(
    reader: SourceReader,
    mover: Mover,
    checkpoint: Checkpoint,
    role: str,
    file: str,
    writes: dict[tuple[str, str], list[Write]],
    hash_it: bool,
    bar: tqdm,
) -> str | None:
    """Read one source file in order (all of it, hashed, when `hash_it`; else only the
    tensors this plan needs) and move every tensor's blocks to their rank files."""
    tensors = sorted(
        (t for t in checkpoint.tensors.values() if t.file == file), key=lambda t: t.info.offset
    )
    digest = hashlib.sha256() if hash_it else None
    path = checkpoint.root / file
    fd = os.open(path, os.O_RDONLY)
    _advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
    try:
        header_size = tensors[0].info.offset if tensors else path.stat().st_size
        if digest is not None:
            reader.hash_bytes(digest, os.pread(fd, header_size, 0))
        bar.update(header_size)
        for tensor in tensors:
            info, targets = tensor.info, writes.get((role, tensor.name), [])
            if digest is None and _copy_whole_rows(mover, fd, info, targets):
                bar.update(info.nbytes)
                continue
            if not targets and digest is None:
                bar.update(info.nbytes)
                continue
            for start, chunk in reader.chunks(fd, info, digest):
                _scatter_chunk(mover, info, start, chunk, targets)
                bar.update(len(chunk))
    finally:
        os.close(fd)
    return reader.hexdigest(digest) if digest is not None else None


def _copy_whole_rows(mover: Mover, fd: int, info: TensorInfo, targets: list[Write]) -> bool:
    """Move a tensor whose every block is whole rows of the same dtype file to file, in
    the kernel. False (nothing done) when a block needs the bytes here."""
    if not targets or any(t.cols is not None or t.dtype != info.dtype for t in targets):
        return False
    for target in targets:
        first, last = target.rows
        offset = target.row_offset + target.dest_row * target.row_bytes
        count = (last - first) * info.row_bytes
        source_offset = info.offset + first * info.row_bytes
        if count and not mover.copy(target.file, fd, source_offset, count, offset):
            return False  # only ever on the very first kernel copy: nothing was moved yet
    return True


def _scatter_chunk(
    mover: Mover, info: TensorInfo, start: int, chunk: memoryview, targets: list[Write]
) -> None:
    if not targets or not len(chunk):
        return
    row_bytes = info.row_bytes
    rows = len(chunk) // row_bytes
    end = start + rows
    for target in targets:
        first, last = max(start, target.rows[0]), min(end, target.rows[1])
        if first >= last:
            continue
        if target.cols is None and target.dtype == info.dtype:
            data: memoryview | np.ndarray = chunk[
                (first - start) * row_bytes : (last - start) * row_bytes
            ]
        else:
            block = np.frombuffer(chunk, np.uint8).reshape(rows, row_bytes)[
                first - start : last - start
            ]
            if target.cols is not None:
                size = DTYPE_SIZES[info.dtype]
                block = block[:, target.cols[0] * size : target.cols[1] * size]
            data = np.ascontiguousarray(block)
            if target.dtype != info.dtype:
                data = _cast(data, info.dtype, target.dtype)
        dest_row = target.dest_row + first - target.rows[0]
        mover.write(target.file, data, target.row_offset + dest_row * target.row_bytes)


def _cast(data: np.ndarray, source: str, dest: str) -> np.ndarray:
    """Raw bytes of `source` dtype -> raw bytes of `dest` (torch only for this)."""
    import torch

    dtypes = _torch_dtypes(torch)
    values = torch.from_numpy(data.reshape(-1)).view(dtypes[source])
    return values.to(dtypes[dest]).view(torch.uint8).numpy()


def _torch_dtypes(torch: Any) -> dict[str, Any]:
    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }


def cached_hub_sha256(checkpoint: Checkpoint, file: str) -> str | None:
    """A file in the Hugging Face cache links to a blob named by its sha256 (the Hub's
    LFS object id) in the repo's `blobs` folder."""
    path = checkpoint.root / file
    if not path.is_symlink():
        return None
    blob = path.resolve()
    name = blob.name
    if blob.parent.name != "blobs" or len(name) != 64:
        return None
    return name if all(c in "0123456789abcdef" for c in name) else None
