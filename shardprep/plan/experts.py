"""FusedMoE's expert stacks: the pieces of `w13_weight` and `w2_weight` from each
expert's tensors, and the blocks a MoE rank holds of a stack (the experts it holds, each
cut as `ExpertSplit` says)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shardprep.errors import PlanError
from shardprep.plan.cuts import EXPERT_VECTORS, Block, Cut, Piece
from shardprep.plan.layout import block_shape, piece_geometry, placed_blocks
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


def expert_stack_blocks(
    pieces: Sequence[Piece],
    shapes: Mapping[str, tuple[int, ...]],
    split: ExpertSplit,
    moe_rank: int,
) -> tuple[tuple[Block, ...], tuple[int, ...]]:
    """The blocks of an expert stack on MoE rank `moe_rank` and the stack's shape
    [experts held, rows per expert, *trailing] ([experts held, values] for a vector per
    expert). Each held expert is cut `split.cut` ways (whole under expert parallelism);
    experts not held are left out."""
    held = split.experts(moe_rank)
    if not held:
        raise PlanError(
            f"MoE rank {moe_rank} of {split.size} would hold none of the {split.num_experts} "
            "experts; choose a tp x dp no larger than the number of experts"
        )
    ways, index = split.cut(moe_rank)
    per_expert: dict[int, list[Block]] = {expert: [] for expert in held}
    heights = dict.fromkeys(held, 0)
    trailing: set[tuple[int, ...]] = set()
    # Hundreds of experts share a few geometries (a layer's gate, up and down): each is
    # worked out once, where a piece's cut, heads, scale or shape first differs from the
    # piece before it, and only placed for the others.
    kind: tuple[object, ...] = ()
    geometry: tuple[Block, ...] = ()
    height = 0
    for piece in pieces:
        expert = piece.expert
        if expert is None or expert not in per_expert:
            continue
        shape = shapes[piece.source]
        this = (piece.cut, piece.heads, piece.scale_of, shape)
        if this != kind:
            kind, geometry = this, piece_geometry(piece, shape, ways, index)
            height = sum(b.height for b in geometry)
            trailing.update(block_shape(b, shape)[1:] for b in geometry)
        per_expert[expert] += placed_blocks(piece, shape, geometry)
        heights[expert] += height
    absent = [expert for expert, blocks in per_expert.items() if not blocks]
    if absent:
        raise PlanError(f"expert {absent[0]} has no tensor in this stack; the checkpoint lacks it")
    rows = set(heights.values())
    if len(rows) != 1 or len(trailing) != 1:
        names = sorted({p.source for p in pieces if p.expert in per_expert})
        raise PlanError(
            f"the experts {names[0]} .. {names[-1]} do not all have the same shape; "
            "every expert of a layer must"
        )
    stacked = tuple(block for expert in held for block in per_expert[expert])
    if all(piece.cut is Cut.PER_TENSOR for piece in pieces):  # [E], or [E, parts]
        per = rows.pop()
        return stacked, (len(held), per) if per > 1 else (len(held),)
    if all(piece.cut in EXPERT_VECTORS for piece in pieces):
        return stacked, (len(held) * rows.pop(), *trailing.pop())
    return stacked, (len(held), rows.pop(), *trailing.pop())
