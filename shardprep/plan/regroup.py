"""How a rank of another topology is made from an artifact's rank tensors: for each
parameter, the reads (which rows of which stored tensor of which artifact rank) and the
zero rows (`shardprep.plan.regions` does the arithmetic). Pure: nothing is read here;
`shardprep.loader.regroup` executes the reads."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

from shardprep.errors import PlanError, TopologyMismatchError
from shardprep.format.records import (
    Manifest,
    ModelEntry,
    ParamSpec,
    PieceEntry,
    rank_key,
    split_rank_key,
)
from shardprep.plan.cuts import Cut, Piece, ScaleOf
from shardprep.plan.records import TensorPlan
from shardprep.plan.regions import Read, Stored, locate, rank_tensor, stored_blocks
from shardprep.plan.topology import ExpertSplit


@dataclass(frozen=True)
class TensorReads:
    """How one parameter of the new rank is made: its plan, the reads that fill it, and
    the row ranges of its zero padding."""

    name: str
    tensor: TensorPlan
    reads: list[Read]
    zeros: list[tuple[int, int]]


def plan_regroup(
    artifact: Path,
    manifest: Manifest,
    entry: ModelEntry,
    wanted: list[str],
    *,
    tp: int,
    tp_rank: int,
    experts: tuple[ExpertSplit, int] | None = None,
    stages: Collection[int] = (),
) -> Iterator[TensorReads]:
    """For each parameter in `wanted` that the artifact has, cut for tp rank `tp_rank` of
    `tp`, the reads that make it (nothing is read here). `experts`: vLLM's (ExpertSplit,
    moe rank) of this rank. `stages`: the artifact stages this rank reads
    (`worker_stages`); a tensor that other stages hold too (the embeddings a draft shares)
    is read from them. Each parameter is first made from the artifact ranks that make
    this rank (its stages, its tp ranks), and from the others only where those cannot."""
    topo = manifest.topology
    holders = _holders(entry)
    art_split = None
    if entry.experts is not None:
        e = entry.experts
        art_split = ExpertSplit(e.num_experts, topo.tp, e.dp, e.expert_parallel, e.placement)
    new_split, moe_rank = experts if experts is not None else (None, tp_rank)
    ways = new_split.size if new_split is not None else tp
    cut = ways > 1 and (new_split is None or not new_split.uses_ep)
    if cut and art_split is not None and art_split.uses_ep:  # parts of experts: not stored
        raise TopologyMismatchError(
            f"artifact {artifact} holds whole experts on each rank (converted with "
            f"--enable-expert-parallel) but vLLM runs tp{tp} without expert parallelism, "
            f"which cuts every expert {ways} ways; start vLLM with --enable-expert-parallel "
            "(or at tp1), or convert again without it"
        )
    ratio = topo.tp // tp
    own_ranks = set(range(tp_rank * ratio, (tp_rank + 1) * ratio))

    def preference(holder: str) -> tuple[bool, bool, str]:
        pp, holder_tp, _ = split_rank_key(holder)
        return (pp not in stages, holder_tp not in own_ranks, holder)

    split = new_split if art_split is not None else None
    for name in wanted:
        if name not in entry.pieces:
            continue
        pieces = tuple(map(_piece, entry.pieces[name]))
        held = sorted((h for h, params in holders.items() if name in params), key=preference)
        if not held:
            continue
        dtype = holders[held[0]][name].dtype

        stored = Holders(entry, manifest, art_split, name, pieces, dtype)
        try:
            mine = rank_tensor(
                name, pieces, entry.source_shapes, dtype, tp, tp_rank, split, moe_rank
            )
            near = [h for h in held if not any(preference(h)[:2])]
            try:
                reads, zeros = locate(mine, stored.blocks(near or held), held)
            except PlanError:
                if not near or len(near) == len(held):
                    raise
                reads, zeros = locate(mine, stored.blocks(held), held)
        except PlanError as exc:
            raise TopologyMismatchError(
                f"artifact {artifact} cannot serve tp{tp} rank {tp_rank}: {exc}; it "
                f"serves {manifest.served_topologies()}"
            ) from None
        yield TensorReads(name, mine, reads, zeros)


def _holders(entry: ModelEntry) -> dict[str, dict[str, ParamSpec]]:
    """The artifact's ranks (with their dp rank where experts are stored per dp rank)
    and the parameters each holds."""
    dp_size = 1 if entry.experts is None else entry.experts.dp
    apart = dp_size > 1
    found: dict[str, dict[str, ParamSpec]] = {}
    for key in entry.ranks:
        pp, tp, dp = split_rank_key(key)
        if apart and dp is None:
            continue
        holder = rank_key(pp, tp, dp if apart else None)
        found[holder] = entry.rank_params(pp, tp, dp or 0)
    if apart:  # a rank whose experts are all in its shared files still counts
        for key in entry.ranks:
            pp, tp, dp = split_rank_key(key)
            for d in range(dp_size) if dp is None else ():
                found.setdefault(rank_key(pp, tp, d), entry.rank_params(pp, tp, d))
    return found


def _piece(p: PieceEntry) -> Piece:
    of = p.scale_of
    scale = None if of is None else ScaleOf(of.shape, Cut(of.cut), of.block, of.grid, of.heads)
    return Piece(p.source, Cut(p.cut), p.heads, p.expert, scale, p.q_heads)


@dataclass(frozen=True)
class Holders:
    """Parameter `name` as the artifact's ranks hold it."""

    entry: ModelEntry
    manifest: Manifest
    split: ExpertSplit | None  # the artifact's expert split
    name: str
    pieces: tuple[Piece, ...]
    dtype: str

    def blocks(self, holders: list[str]) -> list[Stored]:
        """Where each source block lies in the tensors of `holders`."""
        tp = self.manifest.topology.tp
        found = []
        for holder in holders:
            _, holder_tp, dp = split_rank_key(holder)
            theirs = rank_tensor(
                self.name, self.pieces, self.entry.source_shapes, self.dtype, tp, holder_tp,
                self.split, (dp or 0) * tp + holder_tp,
            )  # fmt: skip
            found += stored_blocks(holder, theirs)
        return found
