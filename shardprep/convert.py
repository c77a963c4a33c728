"""Execute a plan: read every source byte once, write every output byte once.

Source files are read sequentially in bounded chunks (hashed on the way); each chunk is
scattered straight to its place in every rank file that needs it. Rank files are
written under a temporary name, hashed once complete, then renamed; the manifest is
written last. A journal lets a rerun skip files already complete and verified.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import shardprep
from shardprep import manifest as mf
from shardprep.checkpoint import Checkpoint, open_checkpoint
from shardprep.constants import (
    CHUNK_BYTES,
    COPIED_FILE_PATTERNS,
    DEFAULT_MAX_PART_BYTES,
    FORMAT,
    INCOMPLETE_SUFFIX,
    VLLM_LAYOUT,
    pp_partition_from_env,
)
from shardprep.journal import Journal, fingerprint
from shardprep.layout import Block
from shardprep.plan import FilePlan, Plan, SourceModel, make_plan
from shardprep.safetensors_io import DTYPE_SIZES, TensorInfo, encode_header, numel, sha256_file

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Options:
    tp: int
    pp: int
    draft: str | None = None
    draft_method: str | None = None
    partition: str | None = None
    stage: int | None = None
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES
    dtype: str = "auto"
    revision: str | None = None


def source_model(checkpoint: Checkpoint) -> SourceModel:
    tensors = {n: (t.info.dtype, t.info.shape) for n, t in checkpoint.tensors.items()}
    return SourceModel(checkpoint.config, tensors)


def load_and_plan(model: str, options: Options) -> tuple[Plan, dict[str, Checkpoint]]:
    """Open the checkpoints (headers only) and plan; nothing is written."""
    target = open_checkpoint(model, options.revision)
    checkpoints = {"target": target}
    if options.draft:
        checkpoints["draft"] = open_checkpoint(options.draft)
    plan = make_plan(
        source_model(target),
        tp=options.tp,
        pp=options.pp,
        draft=source_model(checkpoints["draft"]) if options.draft else None,
        draft_method=options.draft_method,
        partition=options.partition or pp_partition_from_env(),
        stage=options.stage,
        max_part_bytes=options.max_part_bytes,
        dtype=options.dtype,
    )
    return plan, checkpoints


def convert(model: str, out: Path, options: Options, *, progress: bool = True) -> mf.Manifest:
    plan, checkpoints = load_and_plan(model, options)
    sources = {"target": model, "draft": options.draft or ""}
    return execute(plan, checkpoints, sources, out, progress=progress)


def execute(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    sources: dict[str, str],
    out: Path,
    *,
    progress: bool = True,
) -> mf.Manifest:
    out = Path(out)
    journal = Journal.open(out, fingerprint(plan, checkpoints), plan)
    done = journal.verified_files(out)
    todo = [f for f in plan.files if f.path not in done]
    source_hashes = _write_rank_files(plan, checkpoints, out, todo, journal, progress)
    extra = [e for role, cp in checkpoints.items() for e in _copy_extras(cp, out, role)]
    manifest = _manifest(plan, checkpoints, sources, journal.done, source_hashes, extra)
    mf.write_manifest(out, manifest)
    journal.remove()
    return manifest


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
    repeat: tuple[int, int] = (1, 1)


@dataclass
class OpenFile:
    plan: FilePlan
    path: Path
    tmp: Path
    fd: int
    remaining: int
    finished: bool = False


def _write_rank_files(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    out: Path,
    todo: list[FilePlan],
    journal: Journal,
    progress: bool,
) -> dict[tuple[str, str], str]:
    files, writes = _open_outputs(todo, out)
    full = plan.stages == tuple(range(plan.topology.pp))
    hashes: dict[tuple[str, str], str] = {}
    total = sum(_bytes_to_read(cp, role, writes, full) for role, cp in checkpoints.items())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    pending: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=1) as hasher, ThreadPoolExecutor(2) as committer:
        reader = SourceReader(hasher)

        def finish(index: int) -> None:
            if not files[index].finished:
                files[index].finished = True
                pending.append(committer.submit(_commit, files[index], journal))

        try:
            for index, handle in enumerate(files):
                if handle.remaining == 0:
                    finish(index)
            for role, checkpoint in checkpoints.items():
                for file in checkpoint.files:
                    digest = _scatter_file(
                        reader, checkpoint, role, file, writes, files, full, bar, finish
                    )
                    if digest:
                        hashes[(role, file)] = digest
            for future in pending:
                future.result()
        except BaseException:
            for handle in files:
                if handle.fd >= 0:
                    os.close(handle.fd)
                handle.tmp.unlink(missing_ok=True)
            raise
        finally:
            bar.close()
    return hashes


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
        os.pwrite(fd, header, 0)
        _preallocate(fd, len(header) + file_plan.nbytes)
        offset = len(header)
        remaining = 0
        for tensor in file_plan.tensors:
            row_bytes = numel(tensor.stacked_shape[1:]) * DTYPE_SIZES[tensor.dtype]
            dest_row = 0
            for block in tensor.blocks:
                rows = block.rows[1] - block.rows[0]
                if block.source is not None:
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
                        )
                    )
                    remaining += rows * row_bytes
                dest_row += rows
            offset += tensor.spec.nbytes
        files.append(OpenFile(file_plan, path, tmp, fd, remaining))
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


class SourceReader:
    """Reads source files in order into two reused buffers, so that hashing a chunk (on
    a worker thread: hashlib releases the GIL) overlaps scattering the next one, and
    fresh memory is not touched over and over."""

    def __init__(self, hasher: ThreadPoolExecutor) -> None:
        self.hasher = hasher
        self.buffers = [memoryview(bytearray(CHUNK_BYTES)) for _ in range(2)]
        self.pending: list[Future[None] | None] = [None, None]
        self.turn = 0

    def _buffer(self, nbytes: int) -> tuple[int, memoryview]:
        slot, self.turn = self.turn, self.turn ^ 1
        if self.pending[slot] is not None:
            self.pending[slot].result()  # type: ignore[union-attr]
            self.pending[slot] = None
        if nbytes > len(self.buffers[slot]):
            self.buffers[slot] = memoryview(bytearray(nbytes))
        return slot, self.buffers[slot][:nbytes]

    def chunks(
        self, fd: int, info: TensorInfo, digest: hashlib._Hash | None
    ) -> Iterator[tuple[int, memoryview]]:
        """(first row, bytes) of consecutive row ranges of at most CHUNK_BYTES (one row
        at least); each chunk is hashed into `digest` in order, in the background."""
        rows_total = info.shape[0] if info.shape else 1
        rows_per_chunk = max(1, CHUNK_BYTES // max(info.row_bytes, 1))
        for start in range(0, rows_total, rows_per_chunk):
            end = min(rows_total, start + rows_per_chunk)
            slot, view = self._buffer((end - start) * info.row_bytes)
            offset = info.offset + start * info.row_bytes
            _pread_all(fd, view, offset)
            # Let the disk fetch the next chunk while this one is hashed and scattered.
            _advise(fd, offset + len(view), CHUNK_BYTES, "POSIX_FADV_WILLNEED")
            if digest is not None:
                self.pending[slot] = self.hasher.submit(digest.update, view)
            yield start, view

    def hexdigest(self, digest: hashlib._Hash) -> str:
        return self.hasher.submit(digest.hexdigest).result()


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    if hasattr(os, advice):
        os.posix_fadvise(fd, offset, length, getattr(os, advice))


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"source file ended early at byte {offset + done:,}")
        done += n


def _scatter_file(
    reader: SourceReader,
    checkpoint: Checkpoint,
    role: str,
    file: str,
    writes: dict[tuple[str, str], list[Write]],
    files: list[OpenFile],
    full: bool,
    bar: tqdm,
    finish: Callable[[int], None],
) -> str | None:
    """Read one source file in order (all of it, hashed, when `full`; else only the
    tensors this plan needs) and scatter every chunk to its rank files."""
    tensors = sorted(
        (t for t in checkpoint.tensors.values() if t.file == file), key=lambda t: t.info.offset
    )
    digest = hashlib.sha256() if full else None
    path = checkpoint.root / file
    fd = os.open(path, os.O_RDONLY)
    _advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
    try:
        if digest is not None:
            header_size = tensors[0].info.offset if tensors else path.stat().st_size
            header = os.pread(fd, header_size, 0)
            reader.hasher.submit(digest.update, header)
            bar.update(len(header))
        for tensor in tensors:
            targets = writes.get((role, tensor.name), [])
            if not targets and digest is None:
                continue
            for start, chunk in reader.chunks(fd, tensor.info, digest):
                _scatter_chunk(tensor.info.dtype, tensor.info.shape, start, chunk, targets, files)
                bar.update(len(chunk))
            for target in targets:
                if files[target.file].remaining == 0:
                    finish(target.file)
    finally:
        os.close(fd)
    return reader.hexdigest(digest) if digest is not None else None


def _scatter_chunk(
    dtype: str,
    shape: tuple[int, ...],
    start: int,
    chunk: memoryview,
    targets: list[Write],
    files: list[OpenFile],
) -> None:
    if not targets or not len(chunk):
        return
    rows = len(chunk) // (numel(shape[1:]) * DTYPE_SIZES[dtype]) if shape else 1
    source = torch.frombuffer(chunk, dtype=torch.uint8).view(TORCH_DTYPES[dtype])
    source = source.view(rows, *shape[1:]) if shape else source
    end = start + rows
    for target in targets:
        up = target.repeat[0]
        needed = (target.rows[0] // up, -(-target.rows[1] // up))
        first, last = max(start, needed[0]), min(end, needed[1])
        if first >= last:
            continue
        block = source[first - start : last - start]
        # Destination rows [low, high) in the (upsampled) coordinates of target.rows.
        low, high = max(first * up, target.rows[0]), min(last * up, target.rows[1])
        if target.repeat != (1, 1):
            block = block.repeat_interleave(up, 0).repeat_interleave(target.repeat[1], 1)
            block = block[low - first * up : high - first * up]
        if target.cols is not None:
            block = block[:, target.cols[0] : target.cols[1]]
        if target.dtype != dtype:
            block = block.to(TORCH_DTYPES[target.dtype])
        data = block.contiguous().view(torch.uint8).numpy().data if block.numel() else b""
        dest_row = target.dest_row + low - target.rows[0]
        handle = files[target.file]
        offset = target.row_offset + dest_row * target.row_bytes
        _pwrite_all(handle.fd, data, offset)
        handle.remaining -= (high - low) * target.row_bytes


def cut_block(source: torch.Tensor, block: Block) -> torch.Tensor:
    """The part of a whole source tensor that `block` names (what the scatter writes)."""
    if block.repeat != (1, 1):
        source = source.repeat_interleave(block.repeat[0], 0)
        source = source.repeat_interleave(block.repeat[1], 1)
    part = source[block.rows[0] : block.rows[1]]
    return part if block.cols is None else part[:, block.cols[0] : block.cols[1]]


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _commit(handle: OpenFile, journal: Journal) -> None:
    """Hash the finished file (it is in the page cache), rename it, record it."""
    os.close(handle.fd)
    handle.fd = -1
    digest = sha256_file(handle.tmp)
    os.replace(handle.tmp, handle.path)
    journal.record(handle.plan.path, digest)


def _copy_extras(checkpoint: Checkpoint, out: Path, role: str) -> list[mf.ExtraFile]:
    folder = out if role == "target" else out / "draft"
    folder.mkdir(parents=True, exist_ok=True)
    copied = []
    names = sorted({p.name for pat in COPIED_FILE_PATTERNS for p in checkpoint.root.glob(pat)})
    for name in names:
        src = checkpoint.root / name
        if not src.is_file():
            continue
        tmp = folder / (name + INCOMPLETE_SUFFIX)
        shutil.copyfile(src, tmp)
        os.replace(tmp, folder / name)
        rel = name if role == "target" else f"draft/{name}"
        copied.append(mf.ExtraFile(rel, src.stat().st_size, sha256_file(folder / name)))
    return copied


def _manifest(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    sources: dict[str, str],
    done: dict[str, str],
    source_hashes: dict[tuple[str, str], str],
    extra: list[mf.ExtraFile],
) -> mf.Manifest:
    models = []
    for model in plan.models:
        checkpoint = checkpoints[model.role]
        ranks: dict[str, dict[str, mf.ParamSpec]] = {}
        for file in plan.files:
            if file.role == model.role:
                specs = ranks.setdefault(mf.rank_key(file.pp, file.tp), {})
                specs.update({t.name: mf.ParamSpec(t.dtype, t.shape) for t in file.tensors})
        source = mf.Source(
            model=sources[model.role],
            repo_id=checkpoint.repo_id,
            revision=checkpoint.revision,
            files=tuple(
                mf.SourceFile(
                    f,
                    (checkpoint.root / f).stat().st_size,
                    source_hashes.get((model.role, f)) or _cached_hub_sha256(checkpoint, f),
                )
                for f in checkpoint.files
            ),
        )
        models.append(
            mf.ModelEntry(
                role=model.role,
                architecture=model.architecture,
                dtype=model.dtype,
                folder=model.folder,
                num_layers=model.num_layers,
                source=source,
                method=model.method,
                ranks=ranks,
                spec_decode_only=model.spec_decode_only,
                shared_with_target=model.shared_with_target,
            )
        )
    files = tuple(
        mf.FileEntry(f.path, f.role, f.pp, f.tp, f.part, _size(f), done[f.path]) for f in plan.files
    )
    topology = mf.Topology(plan.topology.tp, plan.topology.pp, plan.topology.partition)
    return mf.Manifest(
        format=FORMAT,
        shardprep_version=shardprep.__version__,
        vllm_layout=VLLM_LAYOUT,
        topology=topology,
        stages=plan.stages,
        models=tuple(models),
        files=files,
        extra_files=tuple(sorted(extra, key=lambda e: e.path)),
    )


def _size(file: FilePlan) -> int:
    return len(encode_header([t.spec for t in file.tensors], {"format": "pt"})) + file.nbytes


def _cached_hub_sha256(checkpoint: Checkpoint, file: str) -> str | None:
    """A file in the Hugging Face cache links to a blob named by its sha256."""
    path = checkpoint.root / file
    name = path.resolve().name if path.is_symlink() else ""
    return name if len(name) == 64 and all(c in "0123456789abcdef" for c in name) else None
