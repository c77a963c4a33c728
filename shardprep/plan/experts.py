"""FusedMoE's expert stacks: the pieces of `w13_weight` and `w2_weight` from each
expert's tensors, and the blocks a MoE rank holds of a stack (the experts it holds, each
cut as `ExpertSplit` says)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardprep.errors import PlanError
from shardprep.plan.cuts import EXPERT_INDEXED, EXPERT_VECTORS, Block, Cut, Piece, ScaleOf
from shardprep.plan.layout import block_shape, check_expert_row, piece_geometry, placed_blocks
from shardprep.plan.topology import ExpertSplit


def w13_pieces(gate_up: Sequence[tuple[str, str]]) -> tuple[Piece, ...]:
    """FusedMoE's `w13_weight` from each expert's (gate_proj, up_proj), in global expert
    order: per expert, this rank's gate rows then this rank's up rows (`_load_w13`)."""
    return tuple(
        piece
        for expert, (gate, up) in enumerate(gate_up)
        for piece in (Piece(gate, Cut.ROWS, expert=expert), Piece(up, Cut.ROWS, expert=expert))
    )


def w2_pieces(down: Sequence[str]) -> tuple[Piece, ...]:
    """FusedMoE's `w2_weight` from each expert's down_proj: this rank's columns (`_load_w2`)."""
    return tuple(Piece(name, Cut.COLS, expert=expert) for expert, name in enumerate(down))


def is_expert_stack(pieces: Sequence[Piece]) -> bool:
    return bool(pieces) and pieces[0].expert is not None


Kind = tuple[Cut, int, ScaleOf | None, tuple[int, ...]]  # cut, heads, scale, source shape


@dataclass(frozen=True)
class StackKinds:
    """What checking an expert stack on any rank needs of its pieces, worked out once for
    all ranks: the experts whose pieces have the same kinds in the same order, grouped (a
    layer's hundreds of experts are one group), and a piece of each kind to name."""

    pieces: tuple[Piece, ...]
    groups: dict[tuple[Kind, ...], frozenset[int | None]]
    named: dict[Kind, Piece]

    @classmethod
    def of(cls, pieces: tuple[Piece, ...], shapes: Mapping[str, tuple[int, ...]]) -> StackKinds:
        kinds: dict[int | None, list[Kind]] = {}
        named: dict[Kind, Piece] = {}
        for piece in pieces:
            source, cut, heads, expert, scale_of, _ = piece
            shape = shapes[source]
            if expert and cut in EXPERT_INDEXED and expert >= shape[0]:
                check_expert_row(piece, shape)  # names the missing row
            kind = (cut, heads, scale_of, shape)
            if kind not in named:
                named[kind] = piece
            of_expert = kinds.get(expert)
            if of_expert is None:
                kinds[expert] = [kind]
            else:
                of_expert.append(kind)
        groups: dict[tuple[Kind, ...], set[int | None]] = {}
        for expert, of_expert in kinds.items():
            groups.setdefault(tuple(of_expert), set()).add(expert)
        return cls(pieces, {k: frozenset(v) for k, v in groups.items()}, named)

    def shape_on(self, split: ExpertSplit, moe_rank: int) -> tuple[tuple[int, ...], int]:
        """The stack's shape on MoE rank `moe_rank` and its blocks' total height, checking
        that every expert it holds has pieces of one shape."""
        held = split.experts(moe_rank)
        if not held:
            raise PlanError(
                f"MoE rank {moe_rank} of {split.size} would hold none of the "
                f"{split.num_experts} experts; choose a tp x dp no larger than the number of "
                "experts"
            )
        ways, index = split.cut(moe_rank)
        mine = set(held) if split.uses_ep else None
        covered, rows, trailing = 0, set[int](), set[tuple[int, ...]]()
        for kinds, experts in self.groups.items():
            count = len(experts) if mine is None else len(experts & mine)
            if not count:
                continue
            covered += count
            height = 0
            for kind in kinds:
                geometry = piece_geometry(self.named[kind], kind[3], ways, index)
                height += sum(b.height for b in geometry)
                trailing.update(block_shape(b, kind[3])[1:] for b in geometry)
            rows.add(height)
        if covered < len(held):
            present = set().union(*self.groups.values())
            absent = next(expert for expert in held if expert not in present)
            raise PlanError(f"expert {absent} has no tensor in this stack; the checkpoint lacks it")
        if len(rows) != 1 or len(trailing) != 1:
            names = sorted({p.source for p in self.pieces if p.expert in set(held)})
            raise PlanError(
                f"the experts {names[0]} .. {names[-1]} do not all have the same shape; "
                "every expert of a layer must"
            )
        per = rows.pop()
        if all(piece.cut is Cut.PER_TENSOR for piece in self.pieces):  # [E], or [E, parts]
            return ((len(held), per) if per > 1 else (len(held),)), per * len(held)
        if all(piece.cut in EXPERT_VECTORS for piece in self.pieces):
            return (len(held) * per, *trailing.pop()), per * len(held)
        return (len(held), per, *trailing.pop()), per * len(held)


@dataclass(frozen=True)
class StackBlocks:
    """The blocks of an expert stack on one MoE rank, made when asked. A flagship's stacks
    hold millions of blocks (a block per expert piece per rank) that printing a plan never
    needs and writing needs one file at a time; the plan keeps this recipe instead, whose
    checks and shape `expert_stack` has already done."""

    param: str
    split: ExpertSplit
    moe_rank: int
    height: int  # the sum of the blocks' heights: experts held x rows per expert
    pieces: tuple[Piece, ...] = field(repr=False)
    shapes: Mapping[str, tuple[int, ...]] = field(repr=False, compare=False)

    def blocks(self) -> tuple[Block, ...]:
        return _placed(self.pieces, self.shapes, self.split, self.moe_rank)


def expert_stack(
    param: str,
    kinds: StackKinds,
    shapes: Mapping[str, tuple[int, ...]],
    split: ExpertSplit,
    moe_rank: int,
) -> tuple[StackBlocks, tuple[int, ...]]:
    """An expert stack of MoE rank `moe_rank`, checked, and its shape; its blocks when
    asked (`expert_stack_blocks` says what they are)."""
    shape, height = kinds.shape_on(split, moe_rank)
    return StackBlocks(param, split, moe_rank, height, kinds.pieces, shapes), shape


def expert_stack_blocks(
    pieces: tuple[Piece, ...],
    shapes: Mapping[str, tuple[int, ...]],
    split: ExpertSplit,
    moe_rank: int,
) -> tuple[tuple[Block, ...], tuple[int, ...]]:
    """The blocks of an expert stack on MoE rank `moe_rank` and the stack's shape
    [experts held, rows per expert, *trailing] ([experts held, values] for a vector per
    expert). Each held expert is cut `split.cut` ways (whole under expert parallelism);
    experts not held are left out."""
    shape, _ = StackKinds.of(pieces, shapes).shape_on(split, moe_rank)
    return _placed(pieces, shapes, split, moe_rank), shape


def _placed(
    pieces: Sequence[Piece],
    shapes: Mapping[str, tuple[int, ...]],
    split: ExpertSplit,
    moe_rank: int,
) -> tuple[Block, ...]:
    held = split.experts(moe_rank)
    ways, index = split.cut(moe_rank)
    per_expert: dict[int | None, list[Block]] = {expert: [] for expert in held}
    # Hundreds of experts share a few geometries (a layer's gate, up and down): each is
    # worked out once, where a piece's cut, heads, scale or shape first differs from the
    # piece before it, and only placed for the others.
    kind: tuple[object, ...] = ()
    geometry: tuple[Block, ...] = ()
    for piece in pieces:
        blocks = per_expert.get(piece.expert)
        if blocks is None:
            continue
        shape = shapes[piece.source]
        this = (piece.cut, piece.heads, piece.scale_of, shape)
        if this != kind:
            kind, geometry = this, piece_geometry(piece, shape, ways, index)
        blocks += placed_blocks(piece, shape, geometry)
    return tuple(block for expert in held for block in per_expert[expert])
