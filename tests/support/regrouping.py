"""Cutting a rank of a coarser tp out of an artifact's rank tensors, on numpy arrays: what
the loader's regrouping reads, beside what the plan cuts straight from the source."""

from __future__ import annotations

import numpy as np

from shardprep.plan.cuts import Piece
from shardprep.plan.records import TensorPlan
from shardprep.plan.regions import locate, rank_tensor, stored_blocks
from shardprep.plan.topology import ExpertSplit

DTYPE = "F32"


def cut(tensor: TensorPlan, sources: dict[str, np.ndarray]) -> np.ndarray:
    """A rank tensor's bytes straight from the source, as the converter writes them."""
    parts = []
    for block in tensor.blocks:
        if block.source is None:
            width = tensor.stacked_shape[1:] if len(tensor.stacked_shape) > 1 else ()
            parts.append(np.zeros((block.height, *width), np.float32))
            continue
        data = sources[block.source]
        data = (
            np.repeat(np.repeat(data, block.repeat[0], 0), block.repeat[1], 1)
            if (block.repeat != (1, 1))
            else data
        )
        data = data.reshape(1) if data.ndim == 0 else data
        part = data[block.rows[0] : block.rows[1]]
        if block.matrix is not None:  # each dim-0 row's matrix part, transposed
            (a0, a1), (b0, b1) = block.matrix
            part = part[:, a0:a1, b0:b1].transpose(0, 2, 1).reshape(-1, a1 - a0)
        if block.slab is not None:  # each dim-0 row's matrix part, top-left in zeros
            (a0, a1), (b0, b1), (height, width) = block.slab
            matrices = part.reshape(len(part), part.shape[1] if part.ndim > 2 else 1, -1)
            padded = np.zeros((len(part), height, width), np.float32)
            padded[:, : a1 - a0, : b1 - b0] = matrices[:, a0:a1, b0:b1]
            part = padded.reshape(-1, width)
        if block.cols is not None:
            part = part[:, block.cols[0] : block.cols[1]]
        parts.append(part)
    return np.concatenate(parts).reshape(tensor.shape)


def assemble(
    pieces: tuple[Piece, ...],
    sources: dict[str, np.ndarray],
    tp: int,
    new_tp: int,
    rank: int,
    split: tuple[ExpertSplit, ExpertSplit] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Rank `rank` of tp `new_tp` assembled from the blocks of an artifact made at `tp`
    (each element read once), what the plan cuts for it straight from `sources`, and the
    number of elements read."""
    shapes = {name: tuple(a.shape) for name, a in sources.items()}
    old_split, new_split = split if split else (None, None)
    artifact = {
        f"tp{r}": rank_tensor("p", pieces, shapes, DTYPE, tp, r, old_split, r) for r in range(tp)
    }
    mine = rank_tensor("p", pieces, shapes, DTYPE, new_tp, rank, new_split, rank)
    stored = [s for holder, t in artifact.items() for s in stored_blocks(holder, t)]
    ratio = tp // new_tp
    prefer = [f"tp{r}" for r in range(rank * ratio, (rank + 1) * ratio)]
    reads, zeros = locate(mine, stored, prefer)
    files = {h: cut(t, sources).reshape(t.stacked_shape) for h, t in artifact.items()}
    out = np.full(mine.stacked_shape, np.nan, np.float32)
    flat = out.reshape(out.shape[0] if out.ndim else 1, -1)
    for start, end in zeros:
        flat[start:end] = 0
    read = 0
    for r in reads:
        part = files[r.holder].reshape(files[r.holder].shape[0] or 1, -1)[r.rows[0] : r.rows[1]]
        read += part.size
        if r.dest_cols is None:
            flat[r.dest_rows[0] : r.dest_rows[1]] = part
        else:
            flat[r.dest_rows[0] : r.dest_rows[1], r.dest_cols[0] : r.dest_cols[1]] = part
    zero_rows = sum(e - s for s, e in zeros) * (flat.shape[1] if flat.ndim > 1 else 1)
    assert read + zero_rows == out.size  # every element once: no byte read twice
    return out.reshape(mine.shape), cut(mine, sources), read
