"""Cutting a rank of another topology out of an artifact's rank files: pure arithmetic.

An artifact made at tp holds, for every rank tensor, the blocks of its source tensors
that the plan put there (`tensor_plan`). A rank of tp' (dividing tp) computes its own
blocks with the same plan code; each of them is a union of whole blocks of the artifact,
held on one or several of its ranks (replicated tensors on all of them). `locate` picks,
for every block a rank needs, artifact blocks that tile it exactly once, preferring the
artifact ranks that make up this rank, and says which rows of which stored tensor go to
which rows (and columns) of the new tensor. Nothing here reads a byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shardprep.errors import PlanError
from shardprep.plan.archs.base import Param
from shardprep.plan.cuts import Block, Piece
from shardprep.plan.make import tensor_plan
from shardprep.plan.records import SourceModel, TensorPlan
from shardprep.plan.topology import ExpertSplit, Topology


def served_tps(tp: int) -> tuple[int, ...]:
    """The tensor-parallel sizes an artifact made at `tp` serves: the divisors of tp."""
    return tuple(d for d in range(1, tp + 1) if tp % d == 0)


def rank_tensor(
    name: str,
    pieces: Sequence[Piece],
    shapes: Mapping[str, tuple[int, ...]],
    dtype: str,
    tp: int,
    rank: int,
    experts: ExpertSplit | None = None,
    moe_rank: int | None = None,
) -> TensorPlan:
    """Parameter `name` on tp rank `rank` of `tp` (an expert stack: the experts of MoE rank
    `moe_rank` of `experts`), as the plan makes it."""
    source = SourceModel({}, {s: (dtype, tuple(shapes[s])) for s in {p.source for p in pieces}})
    split = experts or ExpertSplit(0, tp)
    return tensor_plan(
        Param(name, tuple(pieces), (), dtype), source, tp, rank, dtype, split,
        rank if moe_rank is None else moe_rank,
    )  # fmt: skip


@dataclass(frozen=True)
class Stored:
    """A block as it lies in the artifact: in tensor `tensor` of the rank `holder`, from
    row `row` of its dim-0 concatenation of blocks."""

    holder: str
    tensor: str
    row: int
    block: Block
    height: int  # the stored tensor's rows as a dim-0 concatenation of its blocks


@dataclass(frozen=True)
class Read:
    """Rows [rows) of the stored tensor `tensor` of `holder` (all its columns; it has
    `height` rows as a dim-0 concatenation of blocks) go to rows [dest_rows) of the new
    tensor, into its columns [dest_cols) (None: all of them)."""

    holder: str
    tensor: str
    height: int
    rows: tuple[int, int]
    dest_rows: tuple[int, int]
    dest_cols: tuple[int, int] | None = None


def stored_blocks(holder: str, tensor: TensorPlan) -> list[Stored]:
    """Where each source block of an artifact tensor lies in it."""
    found, row = [], 0
    if not tensor.shape:  # a scalar: one row
        return [Stored(holder, tensor.name, 0, b, 1) for b in tensor.blocks if b.source]
    height = tensor.stacked_shape[0]  # once: it sums every block's height
    for block in tensor.blocks:
        if block.source is not None:
            found.append(Stored(holder, tensor.name, row, block, height))
        row += block.height
    return found


def locate(
    tensor: TensorPlan, stored: Iterable[Stored], prefer: Sequence[str] = ()
) -> tuple[list[Read], list[tuple[int, int]]]:
    """The reads that fill `tensor` from the artifact's `stored` blocks, and the row
    ranges of its zero padding. Each needed block is tiled by whole stored blocks, each
    read once, taken from the holders in `prefer` first. Raises PlanError naming the
    first block that the artifact cannot make that way."""
    rank = {holder: i for i, holder in enumerate(prefer)}
    by_source: dict[str, list[Stored]] = {}
    for s in stored:
        by_source.setdefault(s.block.source or "", []).append(s)
    for candidates in by_source.values():
        candidates.sort(key=lambda s: (rank.get(s.holder, len(rank)), s.holder, s.row))
    reads: list[Read] = []
    zeros: list[tuple[int, int]] = []
    row = 0
    for block in tensor.blocks:
        height = block.height
        if block.source is None or _area(block) == 0:  # zero rows, or a slab of zeros
            if height:  # (a rank may hold no row of an MXFP4 stack: nothing to fill)
                zeros.append((row, row + height))
        else:
            reads += _tile(tensor.name, block, row, by_source.get(block.source, []))
        row += height
    return reads, zeros


def _tile(name: str, need: Block, row: int, candidates: Sequence[Stored]) -> list[Read]:
    chosen: list[Block] = []
    reads: list[Read] = []
    area = _area(need)
    for s in candidates:
        have = s.block
        if have.repeat != need.repeat or (have.cols is None) != (need.cols is None):
            continue
        if (have.matrix is None) != (need.matrix is None):
            continue
        if (have.slab is None) != (need.slab is None):
            continue
        if have != need and (_padded(have) or _padded(need)):
            continue  # a padded expert (MXFP4 for one tp): only the very same block
        per_expert = need.matrix is not None or need.slab is not None
        if per_expert and (have.rows != need.rows or need.rows[1] - need.rows[0] > 1):
            continue  # a part of an expert's matrix: the same expert's, one at a time
        if not _inside(have, need) or any(_overlap(have, c) for c in chosen):
            continue
        chosen.append(have)
        (have_rows, have_cols), (need_rows, need_cols) = _span(have), _span(need)
        height = have.height
        start = row + have_rows[0] - need_rows[0]
        cols = None
        if (need.cols, need.matrix, need.slab) != (None, None, None) and have_cols != need_cols:
            cols = (have_cols[0] - need_cols[0], have_cols[1] - need_cols[0])
        reads.append(
            Read(
                s.holder, s.tensor, s.height, (s.row, s.row + height), (start, start + height), cols
            )
        )
        area -= _area(have)
        if area == 0:
            return reads
    columns = f", columns {need.cols[0]}-{need.cols[1] - 1}" if need.cols else ""
    raise PlanError(
        f"{name}: rows {need.rows[0]}-{need.rows[1] - 1}{columns} of {need.source} are not "
        "whole blocks of the artifact's rank tensors"
    )


def _span(block: Block) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows and columns a block covers, in the destination's terms: a transposed
    block's destination rows are its matrix columns, and its columns the matrix rows; a
    slab's are its matrix rows and columns."""
    if block.matrix is not None:
        return block.matrix[1], block.matrix[0]
    if block.slab is not None:
        return block.slab[0], block.slab[1]
    return block.rows, block.cols or (0, 1)


def _padded(block: Block) -> bool:
    """A slab whose zero matrix is larger than its part (an MXFP4 expert padded by the MoE
    backend for one tp): its rows and columns are not those of any other tp."""
    if block.slab is None:
        return False
    (a0, a1), (b0, b1), size = block.slab
    return (a1 - a0, b1 - b0) != size


def _area(block: Block) -> int:
    (r0, r1), (c0, c1) = _span(block)
    return (r1 - r0) * (c1 - c0)


def _inside(inner: Block, outer: Block) -> bool:
    (ir, ic), (orow, oc) = _span(inner), _span(outer)
    return orow[0] <= ir[0] and ir[1] <= orow[1] and oc[0] <= ic[0] and ic[1] <= oc[1]


def _overlap(a: Block, b: Block) -> bool:
    (ar, ac), (br, bc) = _span(a), _span(b)
    return ar[0] < br[1] and br[0] < ar[1] and ac[0] < bc[1] and bc[0] < ac[1]


def stages_for(artifact: Topology, partition: Sequence[int], stage: int) -> tuple[int, ...]:
    """The artifact's stages whose rank files hold the layers of `stage` of the pipeline
    split `partition` (layers per stage); the first and last artifact stages (embeddings,
    head, draft) come with the first and last stages, which hold the first and last layer.

    >>> stages_for(Topology(2, 2, (3, 3)), (2, 2, 2), 1)
    (0, 1)
    """
    if sum(partition) != sum(artifact.partition):
        raise PlanError(
            f"the pipeline split {','.join(map(str, partition))} has {sum(partition)} layers, "
            f"the artifact's model {sum(artifact.partition)}"
        )
    if not 0 <= stage < len(partition):
        raise PlanError(f"stage {stage} is not one of the {len(partition)} stages (0 to "
                        f"{len(partition) - 1})")  # fmt: skip
    first = sum(partition[:stage])
    last = first + partition[stage] - 1
    return tuple(range(artifact.stage_of_layer(first), artifact.stage_of_layer(last) + 1))


def tp_ranks_for(artifact_tp: int, tp: int, rank: int) -> range:
    """The artifact's tp ranks whose files make rank `rank` of `tp` (dividing artifact_tp):
    every cut splits a tensor into contiguous runs in rank order, so a coarser rank is
    made of the k = artifact_tp / tp ranks rank*k .. rank*k + k - 1.

    >>> tp_ranks_for(8, 2, 1)
    range(4, 8)
    """
    if tp < 1 or artifact_tp % tp:
        raise PlanError(f"tp{tp} is not a divisor of the artifact's tp{artifact_tp}")
    if not 0 <= rank < tp:
        raise PlanError(f"rank {rank} is not one of the {tp} ranks of tp{tp} (0 to {tp - 1})")
    k = artifact_tp // tp
    return range(rank * k, rank * k + k)


def expert_ranks_for(stored: ExpertSplit, running: ExpertSplit, moe_rank: int) -> tuple[int, ...]:
    """The artifact's MoE ranks (dp rank x tp + tp rank of `stored`, its expert split)
    whose expert stacks hold a part of what MoE rank `moe_rank` of `running` (vLLM's split)
    holds: one of its experts, in a cut of the expert that overlaps its own. Without expert
    parallelism on either side a coarser rank is made of the same ranks as `tp_ranks_for`;
    with it on both (the same placement) of the EP ranks whose experts it takes; across
    the two, of every rank.

    >>> expert_ranks_for(ExpertSplit(8, 4), ExpertSplit(8, 2), 1)
    (2, 3)
    >>> expert_ranks_for(ExpertSplit(8, 4, 1, True), ExpertSplit(8, 2, 1, True), 0)
    (0, 1)
    >>> expert_ranks_for(ExpertSplit(8, 4), ExpertSplit(8, 2, 1, True), 0)
    (0, 1, 2, 3)
    """
    if stored.num_experts != running.num_experts:
        raise PlanError(
            f"vLLM runs {running.num_experts} experts per layer, the artifact holds "
            f"{stored.num_experts}"
        )
    wanted = set(running.experts(moe_rank))
    ways, index = running.cut(moe_rank)
    found = []
    for rank in range(stored.size):
        their_ways, their_index = stored.cut(rank)
        overlaps = (
            index * their_ways < (their_index + 1) * ways
            and their_index * ways < (index + 1) * their_ways
        )
        if overlaps and wanted.intersection(stored.experts(rank)):
            found.append(rank)
    return tuple(found)


def worker_stages(
    artifact: Topology, partition: Sequence[int], stage: int, draft: bool = False
) -> tuple[int, ...]:
    """The artifact's stages a worker at `stage` of the split `partition` reads: those of
    its layers (`stages_for`), or for a draft (which lives on the last stage of any split)
    the artifact's last stage."""
    return (artifact.last_stage,) if draft else stages_for(artifact, partition, stage)
