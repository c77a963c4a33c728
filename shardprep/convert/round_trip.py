"""`verify --full`'s round trip: every block of every rank file compared with the source
bytes it was cut from, and every source element found in some rank file. It goes source
file by source file, so that a Hub source can be downloaded within a budget, each file
deleted once compared (`replay.sources_in_turn`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shardprep.convert.checkpoint import Checkpoint
from shardprep.errors import summarize
from shardprep.format import manifest as mf
from shardprep.format.dtypes import cast, torch_dtype
from shardprep.format.headers import read_header
from shardprep.plan.cuts import Block
from shardprep.plan.records import Plan
from shardprep.progress import Progress as tqdm

# The blocks that read one source file of one checkpoint; file None: no file (padding, or
# a side tensor held in memory).
Key = tuple[int, str | None]


@dataclass(frozen=True)
class Item:
    """One block of a rank tensor: where it lies, and the source rows it holds."""

    role: str
    path: str  # the rank file, relative to the artifact
    name: str
    shape: tuple[int, ...]  # the tensor's stacked shape: rows first
    row: int  # its first row in that shape
    block: Block


def round_trip(
    out: Path,
    manifest: mf.Manifest,
    units: set[tuple[int, int]],
    *,
    complete: bool,
    progress: bool,
    budget: int | None,
    watch: Callable[[], None] | None = None,
) -> tuple[list[str], int]:
    """Replay the recorded request (`replay.py`) and compare the rank files of `units`
    ((stage, tp rank)); `complete`: they are every rank, so every source element must be
    in one. The problems found, and how many source tensors were rebuilt. `budget`: most
    bytes of a Hub source's files on disk at once, in a temporary folder (None: the
    Hugging Face cache)."""
    from shardprep.convert.replay import Disagreement, replay, sources_in_turn

    try:
        plan, checkpoints = replay(manifest, out)
    except Disagreement as exc:
        return [str(exc)], 0
    problems: list[str] = []
    work = _work(out, manifest, plan, checkpoints, units, problems)
    reader = _Reader(out)
    covered: dict[tuple[str, str], torch.Tensor] = {}
    total = sum(len(items) for items in work.values())
    with tqdm(total=total, desc="round trip", disable=not progress) as bar:
        originals = {id(cp): cp for cp in checkpoints.values()}
        for (key, file), items in work.items():
            if file is None:
                _compare(items, originals[key], reader, covered, problems)
                bar.update(len(items))
        wanted: dict[int, set[str]] = {}
        for key, file in work:
            if file is not None:
                wanted.setdefault(key, set()).add(file)
        turns = sources_in_turn(plan, checkpoints, wanted, budget, progress, watch)
        with contextlib.closing(turns):  # a budget's temporary folder goes at once
            for key, checkpoint, file in turns:
                _compare(work[(key, file)], checkpoint, reader, covered, problems)
                reader.forget(checkpoint.root / file)  # closed before it is deleted
                bar.update(len(work[(key, file)]))
    for (role, name), mask in covered.items():
        if complete and not bool(mask.all()):
            problems.append(f"{role}: parts of {name} are in no rank file")
    return problems, len(covered)


def _work(
    out: Path,
    manifest: mf.Manifest,
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    units: set[tuple[int, int]],
    problems: list[str],
) -> dict[Key, list[Item]]:
    """Every block of the rank files of `units`, by the source file it reads."""
    located = _locate(out, manifest, units)
    work: dict[Key, list[Item]] = {}
    for file_plan in plan.files:
        if (file_plan.pp, file_plan.tp) not in units:
            continue
        checkpoint = checkpoints[file_plan.role]
        for tensor in file_plan.tensors:
            key = (file_plan.role, file_plan.pp, file_plan.tp, file_plan.dp, tensor.name)
            shape = tensor.stacked_shape or (1,)  # a 0-d parameter: one row
            if key not in located:
                problems.append(f"{file_plan.path}: {tensor.name} is in no rank file")
                continue
            path, stored = located.pop(key)
            if math.prod(stored) != math.prod(shape):
                problems.append(f"{path}: {tensor.name} is not the shape replayed")
                continue
            row = 0
            for block in tensor.blocks:
                source = block.source
                file = None
                if source is not None and source not in checkpoint.side_tensors:
                    file = checkpoint.tensors[source].file
                item = Item(file_plan.role, path, tensor.name, shape, row, block)
                work.setdefault((id(checkpoint), file), []).append(item)
                row += block.height
    extra = sorted(f"{path}: {name}" for (*_, name), (path, _) in located.items())
    if extra:  # in the rank files and the manifest, but not what the source gives
        problems.append(f"{summarize(extra)} {'are' if len(extra) > 1 else 'is'} not replayed")
    return work


def _compare(
    items: list[Item],
    checkpoint: Checkpoint,
    reader: _Reader,
    covered: dict[tuple[str, str], torch.Tensor],
    problems: list[str],
) -> None:
    for item in items:
        block = item.block
        part = reader.dest(item)[item.row : item.row + block.height]
        if block.source is None:
            if torch.count_nonzero(part):
                problems.append(f"{item.path}: padding of {item.name} is not zero")
            continue
        source = reader.source(checkpoint, block.source)
        if not _same_bytes(part, cast(torch, cut_block(source, block), part.dtype)):
            problems.append(
                f"{item.path}: {item.name} differs from {block.source} rows {block.rows}"
            )
        mask = covered.setdefault(
            (item.role, block.source), torch.zeros(_mask_shape(source), dtype=torch.bool)
        )
        _mark(mask, block)


class _Reader:
    """Open safetensors files, and the last rank tensor read (its blocks come in a row)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.handles: dict[str, safe_open] = {}
        self.last: tuple[tuple[str, str], torch.Tensor] | None = None

    def dest(self, item: Item) -> torch.Tensor:
        key = (item.path, item.name)
        if self.last is None or self.last[0] != key:
            tensor = self._open(self.out / item.path).get_tensor(item.name)
            self.last = (key, tensor.reshape(item.shape))
        return self.last[1]

    def source(self, checkpoint: Checkpoint, name: str) -> torch.Tensor:
        info = checkpoint.tensors[name].info
        if name in checkpoint.side_tensors:
            raw = torch.frombuffer(bytearray(checkpoint.side_tensors[name]), dtype=torch.uint8)
            return raw.view(torch_dtype(torch, info.dtype)).view(info.shape)
        path = checkpoint.root / checkpoint.tensors[name].file
        return self._open(path).get_tensor(name)

    def forget(self, path: Path) -> None:
        self.handles.pop(str(path), None)

    def _open(self, path: Path) -> safe_open:
        key = str(path)
        if key not in self.handles:
            self.handles[key] = safe_open(key, framework="pt")
        return self.handles[key]


def _locate(
    out: Path, manifest: mf.Manifest, units: set[tuple[int, int]]
) -> dict[tuple[str, int, int, int | None, str], tuple[str, tuple[int, ...]]]:
    """Each rank tensor of `units`: the file that holds it, and its stored shape."""
    located = {}
    for entry in manifest.files:
        if (entry.pp, entry.tp) not in units:
            continue
        for name, info in read_header(out / entry.path).tensors.items():
            located[(entry.role, entry.pp, entry.tp, entry.dp, name)] = (entry.path, info.shape)
    return located


def _mask_shape(source: torch.Tensor) -> tuple[int, ...]:
    if source.dim() == 0:
        return (1,)
    return tuple(source.shape[:2])


def _mark(mask: torch.Tensor, block: Block) -> None:
    """Mark the source rows (and columns) that `block` reads."""
    (up, across), rows, cols = block.repeat, block.rows, block.cols
    first, last = rows[0] // up, -(-rows[1] // up)
    if block.matrix is not None:  # the dims after the first two are not tracked
        mask[first:last, block.matrix[0][0] : block.matrix[0][1]] = True
    elif block.slab is not None:
        (a0, a1), (b0, b1), (height, _) = block.slab  # a vector per expert: its columns
        span = (b0, b1) if height == 1 else (a0, a1)
        mask[first:last, span[0] : span[1]] = True
    elif cols is None:
        mask[first:last] = True
    else:
        mask[first:last, cols[0] // across : -(-cols[1] // across)] = True


def cut_block(source: torch.Tensor, block: Block) -> torch.Tensor:
    """The part of a whole source tensor that `block` names (what the scatter writes)."""
    if source.dim() == 0:  # a per-tensor scale: one row of its parameter
        source = source.reshape(1)
    if block.repeat != (1, 1):
        source = source.repeat_interleave(block.repeat[0], 0)
        source = source.repeat_interleave(block.repeat[1], 1)
    part = source[block.rows[0] : block.rows[1]]
    if block.slab is not None:
        (a0, a1), (b0, b1), (height, width) = block.slab
        inner = part.shape[1] if part.dim() > 2 else 1
        values = part.reshape(part.shape[0], inner, -1)[:, a0:a1, b0:b1]
        out = torch.zeros((part.shape[0], height, width), dtype=part.dtype)
        out[:, : a1 - a0, : b1 - b0] = values
        return out.reshape(part.shape[0] * height, width)  # a rank may hold 0 columns
    if block.matrix is not None:
        (a0, a1), (b0, b1) = block.matrix
        return part[:, a0:a1, b0:b1].transpose(1, 2).reshape(-1, a1 - a0)
    return part if block.cols is None else part[:, block.cols[0] : block.cols[1]]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values in the same order; the shapes may differ by dims of one (an expert
    stack with one row of scales per expert reads as a vector per expert)."""
    if a.numel() != b.numel() or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_as_bytes(a), _as_bytes(b)))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
