"""Moving the bytes of a plan: every source byte read once, every output byte written once.

Source files are read from the page cache, tensor by tensor in the order of the tensors'
destinations (`_landing`), so that each rank file's prefix grows, and is hashed, as the
copy goes. The files whose sha256 is known (or not wanted: a one-stage plan) are read
together, whichever file holds each tensor: all of a local source's at once, a Hub
source's as each download ends. A file hashed here is read on its own, and hashed whole,
in file order, on another thread meanwhile (which may finish it while the next files
move, up to `HASH_LAG` bytes behind). A tensor whose rank slices are whole rows of the
same dtype goes from file to file inside the kernel (`copy_file_range`); other tensors
are mapped in bounded windows and scattered (columns gathered, dtypes cast) to every
rank file that needs them. Rank files are hashed while they are written (`rankfiles.py`).

A source file that lives in the Hugging Face cache is a blob named by its sha256, and one
that `hf download --local-dir` fetched has its sha256 recorded beside it: that sha256 is
recorded as its hash without reading it for that purpose (`rehash_source` hashes it
anyway and fails if it differs).
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from shardprep.constants import CHUNK_BYTES
from shardprep.convert.checkpoint import Checkpoint, KnownSha256, known_sha256
from shardprep.convert.journal import Journal
from shardprep.convert.place import scatter_chunk
from shardprep.convert.rankfiles import Mover, Write, open_outputs
from shardprep.errors import CorruptFileError
from shardprep.format.headers import TensorInfo
from shardprep.hashing import sha256_file
from shardprep.plan.records import FilePlan, Plan
from shardprep.progress import Progress as tqdm

OUTPUT_HASHERS = 2  # worker threads hashing rank files (each file always on the same one)
SOURCE_HASHERS = 2  # worker threads hashing source files, a file each
# How far the hashing of source files may fall behind their move, in bytes of files whose
# sha256 is not finished (always at least the file just moved): the page cache must keep
# what is not hashed yet, or it is read from disk again.
HASH_LAG = 4 * 1024**3


def write_rank_files(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    out: Path,
    todo: list[FilePlan],
    journal: Journal,
    *,
    progress: bool,
    rehash_source: bool = False,
    arrived: Callable[[Checkpoint, list[str]], Iterable[list[str]]] | None = None,
    done: Callable[[Checkpoint, str], None] | None = None,
) -> dict[tuple[str, str], str]:
    """Write every file of `todo`; returns the sha256 of each source file read whole.
    `arrived(checkpoint, files)` yields the source files to read in batches, each batch
    once all of it is here to be read (the order does not change a byte of the output:
    every block has its place); `done(checkpoint, file)` is called once every tensor of
    it is written."""
    files, writes = open_outputs(todo, out)
    full = plan.stages == tuple(range(plan.topology.pp))
    sources = _distinct(checkpoints)
    total = sum(_bytes_to_read(cp, roles, writes, full) for roles, cp in sources)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    hashers = [ThreadPoolExecutor(SOURCE_HASHERS)]
    hashers += [ThreadPoolExecutor(1) for _ in range(OUTPUT_HASHERS)]
    mover = Mover(files, journal, hashers[1:])
    source_hashes: dict[tuple[str, str], str] = {}
    try:
        mover.catch_up()
        reader = SourceReader(hashers[0])
        for roles, checkpoint in sources:
            # A file of another stage is not read (a Hub source's not fetched).
            needed = [f for f in checkpoint.files if full or _feeds(checkpoint, roles, f, writes)]
            for batch in arrived(checkpoint, needed) if arrived is not None else [needed]:
                claims = {f: known_sha256(checkpoint, f) if full else None for f in batch}
                hashed = [f for f in batch if _hash_here(claims[f], full, rehash_source)]
                together = [f for f in batch if f not in hashed]
                _scatter_together(reader, mover, checkpoint, roles, together, writes, bar, full)
                digests = _scatter_hashed(reader, mover, checkpoint, roles, hashed, writes, bar)
                for file in batch:
                    _record(source_hashes, roles, checkpoint, file, digests.get(file), claims[file])
                if done is not None:
                    mover.wait()
                    for file in batch:
                        done(checkpoint, file)
            for name, data in checkpoint.side_tensors.items():
                info = checkpoint.tensors[name].info
                scatter_chunk(mover, info, 0, memoryview(data), _targets(writes, roles, name))
                bar.update(info.nbytes)
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


def _distinct(checkpoints: dict[str, Checkpoint]) -> list[tuple[tuple[str, ...], Checkpoint]]:
    """Each checkpoint once, with the roles it feeds: a target that carries its own draft
    (MTP layers) is read once for both."""
    found: dict[int, tuple[tuple[str, ...], Checkpoint]] = {}
    for role, checkpoint in checkpoints.items():
        roles, _ = found.get(id(checkpoint), ((), checkpoint))
        found[id(checkpoint)] = ((*roles, role), checkpoint)
    return list(found.values())


def _hash_here(claim: KnownSha256 | None, full: bool, rehash_source: bool) -> bool:
    """Whether a source file is hashed as it is read: only in a full conversion (its
    manifest records every source file), where its sha256 is not known or to be checked."""
    return full and (claim is None or rehash_source)


def _record(
    hashes: dict[tuple[str, str], str],
    roles: tuple[str, ...],
    checkpoint: Checkpoint,
    file: str,
    digest: str | None,
    claim: KnownSha256 | None,
) -> None:
    """Record a source file's sha256: what it hashed to, else what is known of it; the
    two must agree."""
    if digest and claim and digest != claim.sha256:
        raise CorruptFileError(
            f"{checkpoint.root / file} hashes to {digest}, not to {claim.claim} "
            f"({claim.sha256}); the download is damaged or the file was changed "
            "since: delete it and download the model again",
            path=str(checkpoint.root / file),
        )
    sha256 = digest or (claim.sha256 if claim else None)
    if sha256:
        for role in roles:
            hashes[(role, file)] = sha256


def _targets(
    writes: dict[tuple[str, str], list[Write]], roles: tuple[str, ...], name: str
) -> list[Write]:
    return [w for role in roles for w in writes.get((role, name), [])]


def _feeds(
    checkpoint: Checkpoint,
    roles: tuple[str, ...],
    file: str,
    writes: dict[tuple[str, str], list[Write]],
) -> bool:
    return any(t.file == file and _targets(writes, roles, n) for n, t in checkpoint.tensors.items())


def _bytes_to_read(
    checkpoint: Checkpoint,
    roles: tuple[str, ...],
    writes: dict[tuple[str, str], list[Write]],
    full: bool,
) -> int:
    if full:
        return sum(checkpoint.size(f) for f in checkpoint.files)
    return sum(t.info.nbytes for n, t in checkpoint.tensors.items() if _targets(writes, roles, n))


class SourceReader:
    """Maps source files window by window (at most CHUNK_BYTES of whole rows each): the
    bytes are scattered straight from the page cache, never copied into a buffer first;
    at most two windows are mapped at a time. A source file hashed here is hashed whole,
    in file order, on one of the reader's own threads (`hash_file`), while its tensors
    move."""

    def __init__(self, hasher: ThreadPoolExecutor) -> None:
        self.hasher = hasher
        self.windows: deque[list[Any]] = deque()
        self.advised = (-1, 0, 0)  # the file and the bytes [start, end) readahead was asked for

    def chunks(self, fd: int, info: TensorInfo) -> Iterator[tuple[int, memoryview]]:
        """(first row, bytes) of consecutive row ranges of at most CHUNK_BYTES (one row
        at least)."""
        rows_total = info.shape[0] if info.shape else 1
        rows_per_chunk = max(1, CHUNK_BYTES // max(info.row_bytes, 1))
        for start in range(0, rows_total, rows_per_chunk):
            end = min(rows_total, start + rows_per_chunk)
            offset, length = info.offset + start * info.row_bytes, (end - start) * info.row_bytes
            while len(self.windows) >= 2:
                self._unmap_oldest()
            window = _map(fd, offset, length)
            self._read_ahead(fd, offset + length)
            self.windows.append(window)
            yield start, window[0]

    def _read_ahead(self, fd: int, offset: int) -> None:
        """Let the disk fetch the next chunk while this one is scattered: asked again only
        once half of what was asked is behind (a file of small tensors would otherwise ask
        for the same 64 MiB once per tensor)."""
        advised_fd, start, end = self.advised
        if fd == advised_fd and start <= offset and offset + CHUNK_BYTES // 2 < end:
            return
        _advise(fd, offset, CHUNK_BYTES, "POSIX_FADV_WILLNEED")
        self.advised = (fd, offset, offset + CHUNK_BYTES)

    def hash_file(self, path: Path) -> Future[str]:
        return self.hasher.submit(sha256_file, path)

    def _unmap_oldest(self) -> None:
        view, whole, mapped = self.windows.popleft()
        view.release()
        whole.release()
        mapped.close()

    def close(self) -> None:
        while self.windows:
            try:
                self._unmap_oldest()
            except BufferError:
                # After an interruption, frames of the traceback may still hold views of a
                # window; it is unmapped when the last of them goes.
                continue


def _map(fd: int, offset: int, length: int) -> list[Any]:
    """[view of bytes offset..offset + length, view of the mapping, the mapping]."""
    first = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, offset + length - first, prot=mmap.PROT_READ, offset=first)
    whole = memoryview(mapped)
    return [whole[offset - first :], whole, mapped]


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    if hasattr(os, advice):
        os.posix_fadvise(fd, offset, length, getattr(os, advice))


def _scatter_hashed(
    reader: SourceReader,
    mover: Mover,
    checkpoint: Checkpoint,
    roles: tuple[str, ...],
    files: list[str],
    writes: dict[tuple[str, str], list[Write]],
    bar: tqdm,
) -> dict[str, str]:
    """Read source files one after the other, each hashed whole in file order on one of
    the reader's threads while its tensors move as `_scatter_together` moves them (both
    read it from the page cache: it is fetched from disk once); returns their sha256.
    The next files move while the hashing finishes the last ones (`catch_up`): a large
    file's hash does not hold back the small files after it, and what is hashed is what
    the move brought into the page cache, at most `HASH_LAG` bytes ago."""
    hashes: dict[str, Future[str]] = {}
    behind: deque[tuple[Future[str], int]] = deque()  # hashes not known to be finished
    try:
        for file in files:
            hashes[file] = reader.hash_file(checkpoint.root / file)
            behind.append((hashes[file], checkpoint.size(file)))
            _scatter_together(reader, mover, checkpoint, roles, [file], writes, bar, True)
            catch_up(behind, HASH_LAG)
    finally:
        wait(hashes.values())
    return {file: future.result() for file, future in hashes.items()}


def catch_up(behind: deque[tuple[Future[str], int]], lag: int) -> None:
    """Before the next source file moves: forget the oldest hashes that are finished, and
    wait for the oldest while the files still being hashed hold more than `lag` bytes.
    The newest, the file just moved, is never waited for."""
    while len(behind) > 1 and (behind[0][0].done() or sum(size for _, size in behind) > lag):
        behind.popleft()[0].result()


def _scatter_together(
    reader: SourceReader,
    mover: Mover,
    checkpoint: Checkpoint,
    roles: tuple[str, ...],
    files: list[str],
    writes: dict[tuple[str, str], list[Write]],
    bar: tqdm,
    whole: bool,
) -> None:
    """Move the tensors of source files in the order of their destinations (`_landing`)
    across the files: a layer whose last part is in the next file (v_proj, say) does not
    hold back every rank file's prefix, and so its hashing, until that file is read."""
    wanted = set(files)
    tensors = [t for t in checkpoint.tensors.values() if t.file in wanted]
    if whole:  # the bytes before each file's first tensor (all of a file without one)
        first = {f: checkpoint.size(f) for f in files}
        for tensor in tensors:
            first[tensor.file] = min(first[tensor.file], tensor.info.offset)
        bar.update(sum(first.values()))
    tensors.sort(key=lambda t: _landing(_targets(writes, roles, t.name), t.info.offset))
    with SourceFiles(checkpoint.root) as sources:
        try:
            for tensor in tensors:
                targets = _targets(writes, roles, tensor.name)
                fd = sources.fd(tensor.file)
                _move_tensor(reader, mover, fd, tensor.info, targets, bar, whole)
        finally:
            reader.close()


class SourceFiles:
    """Source files opened as they are needed, at most `most` at a time (a checkpoint may
    have hundreds; the least recently used is closed first)."""

    def __init__(self, root: Path, most: int = 32) -> None:
        self.root = root
        self.most = most
        self.open: OrderedDict[str, int] = OrderedDict()

    def fd(self, file: str) -> int:
        if file in self.open:
            self.open.move_to_end(file)
            return self.open[file]
        while len(self.open) >= self.most:
            os.close(self.open.popitem(last=False)[1])
        self.open[file] = _open_source(self.root / file)
        return self.open[file]

    def __enter__(self) -> SourceFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        while self.open:
            os.close(self.open.popitem()[1])


def _open_source(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    _advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
    return fd


def _move_tensor(
    reader: SourceReader,
    mover: Mover,
    fd: int,
    info: TensorInfo,
    targets: list[Write],
    bar: tqdm,
    whole: bool,
) -> None:
    """Move one source tensor's blocks to their rank files (file to file in the kernel
    where they are whole rows of the same dtype), counting it on `bar`."""
    if _copy_whole_rows(mover, fd, info, targets):
        bar.update(info.nbytes)
        return
    if not targets:
        bar.update(info.nbytes if whole else 0)
        return
    for start, chunk in reader.chunks(fd, info):
        scatter_chunk(mover, info, start, chunk, targets)
        bar.update(len(chunk))


def _landing(targets: list[Write], offset: int) -> tuple[int, int]:
    """Where a tensor's bytes land first in the rank files (their byte offset), so that a
    source file that is not hashed is read in the order of its destinations: each rank
    file's prefix then grows tensor by tensor and is hashed while the rest is copied (in
    source order, a fused tensor such as qkv_proj, first in its rank file, is complete only
    when its last part, late in the source, is written). Unneeded tensors keep their
    place (`offset`) after the needed ones."""
    if not targets:
        return (1, offset)
    return (0, min(t.row_offset + t.dest_row * t.row_bytes for t in targets))


def _copy_whole_rows(mover: Mover, fd: int, info: TensorInfo, targets: list[Write]) -> bool:
    """Move a tensor whose every block is whole rows of the same dtype file to file, in
    the kernel. False (nothing done) when a block needs the bytes here."""
    if not targets or any(
        t.cols is not None or t.dtype != info.dtype or t.repeat != (1, 1) or t.matrix or t.slab
        for t in targets
    ):
        return False
    for target in targets:
        first, last = target.rows
        offset = target.row_offset + target.dest_row * target.row_bytes
        count = (last - first) * info.row_bytes
        source_offset = info.offset + first * info.row_bytes
        if count and not mover.copy(target.file, fd, source_offset, count, offset):
            return False  # only ever on the very first kernel copy: nothing was moved yet
    return True
