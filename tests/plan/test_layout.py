from __future__ import annotations

import pytest

from shardprep.errors import PlanError
from shardprep.plan.cuts import Block, Cut, Piece, ScaleOf
from shardprep.plan.experts import expert_stack_blocks, w2_pieces, w13_pieces
from shardprep.plan.layout import block_shape, piece_blocks
from shardprep.plan.topology import ExpertSplit


def test_vocab_32001_at_tp2_pads_the_last_rank() -> None:
    piece = Piece("embed", Cut.VOCAB)
    assert piece_blocks(piece, (32001, 8), 2, 0) == (Block("embed", (0, 16032)),)
    assert piece_blocks(piece, (32001, 8), 2, 1) == (
        Block("embed", (16032, 32001)),
        Block(None, (0, 63)),
    )


def test_vocab_rank_entirely_in_padding() -> None:
    # 70 rows pad to 128; at tp4 each rank holds 32, rank 3 holds rows 96.. : all padding.
    piece = Piece("embed", Cut.VOCAB)
    assert piece_blocks(piece, (70, 4), 4, 2) == (Block("embed", (64, 70)), Block(None, (0, 26)))
    assert piece_blocks(piece, (70, 4), 4, 3) == (Block(None, (0, 32)),)


def test_row_parallel_cuts_columns() -> None:
    blocks = piece_blocks(Piece("down", Cut.COLS), (8, 12), 3, 1)
    assert blocks == (Block("down", (0, 8), (4, 8)),)
    assert block_shape(blocks[0], (8, 12)) == (8, 4)


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    piece = Piece("k", Cut.KV_HEADS, heads=2)
    assert [piece_blocks(piece, (32, 64), 4, r)[0].rows for r in range(4)] == [
        (0, 16),
        (0, 16),
        (16, 32),
        (16, 32),
    ]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_fused_gqa_qkv_is_cut_as_its_q_k_and_v_would_be(tp: int) -> None:
    """8 query heads, 2 KV heads of 3 rows: each rank's rows of the fused tensor are its
    rows of q, k and v apart (ROWS, KV_HEADS), KV heads replicated past tp 2."""
    q_rows, kv_rows = 8 * 3, 2 * 3
    fused = Piece("qkv", Cut.QKV_HEADS, heads=2, q_heads=8)
    for rank in range(tp):
        (q,) = piece_blocks(Piece("q", Cut.ROWS), (q_rows, 16), tp, rank)
        (k,) = piece_blocks(Piece("k", Cut.KV_HEADS, heads=2), (kv_rows, 16), tp, rank)
        assert piece_blocks(fused, (q_rows + 2 * kv_rows, 16), tp, rank) == (
            Block("qkv", q.rows),
            Block("qkv", (q_rows + k.rows[0], q_rows + k.rows[1])),
            Block("qkv", (q_rows + kv_rows + k.rows[0], q_rows + kv_rows + k.rows[1])),
        )


def test_a_fused_gqa_qkv_that_does_not_match_its_heads_is_refused() -> None:
    fused = Piece("qkv", Cut.QKV_HEADS, heads=2, q_heads=8)
    with pytest.raises(PlanError, match="qkv has 37 rows, not 8 query heads and 2 key and"):
        piece_blocks(fused, (37, 16), 2, 0)
    with pytest.raises(PlanError, match="qkv has 8 query heads, not divisible by 3"):
        piece_blocks(fused, (36, 16), 3, 0)


def test_divisibility_is_checked() -> None:
    with pytest.raises(PlanError, match="q has 10 rows, not divisible by 4"):
        piece_blocks(Piece("q", Cut.ROWS), (10, 4), 4, 0)
    with pytest.raises(PlanError, match="a column split needs 2-D"):
        piece_blocks(Piece("b", Cut.COLS), (10,), 2, 0)


def test_replicated_scalar_and_vector() -> None:
    assert piece_blocks(Piece("n", Cut.REPLICATE), (7,), 4, 3) == (Block("n", (0, 7)),)
    assert block_shape(Block("s", (0, 1)), ()) == ()


def _stack_shapes(experts: int, inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for e in range(experts):
        shapes[f"g{e}"] = shapes[f"u{e}"] = (inter, hidden)
        shapes[f"d{e}"] = (hidden, inter)
    return shapes


@pytest.mark.parametrize(("experts", "tp", "dp"), [(5, 3, 1), (7, 2, 2), (3, 1, 1), (9, 3, 3)])
def test_expert_stacks_cut_each_expert_by_moe_rank(experts: int, tp: int, dp: int) -> None:
    inter, hidden = 6 * tp * dp, 10
    shapes = _stack_shapes(experts, inter, hidden)
    w13 = w13_pieces([(f"g{e}", f"u{e}") for e in range(experts)])
    w2 = w2_pieces([f"d{e}" for e in range(experts)])
    split = ExpertSplit(experts, tp, dp)
    share = inter // (tp * dp)
    for moe_rank in range(tp * dp):
        blocks, shape = expert_stack_blocks(w13, shapes, split, moe_rank)
        assert shape == (experts, 2 * share, hidden)
        rows = (moe_rank * share, (moe_rank + 1) * share)
        assert blocks == tuple(
            Block(name, rows) for e in range(experts) for name in (f"g{e}", f"u{e}")
        )
        blocks, shape = expert_stack_blocks(w2, shapes, split, moe_rank)
        assert shape == (experts, hidden, share)
        assert blocks == tuple(Block(f"d{e}", (0, hidden), rows) for e in range(experts))


@pytest.mark.parametrize(("experts", "tp", "dp"), [(7, 2, 1), (10, 2, 2), (5, 5, 1), (11, 3, 2)])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_parallel_stacks_hold_whole_experts(
    experts: int, tp: int, dp: int, placement: str
) -> None:
    inter, hidden = 6, 4
    shapes = _stack_shapes(experts, inter, hidden)
    w13 = w13_pieces([(f"g{e}", f"u{e}") for e in range(experts)])
    w2 = w2_pieces([f"d{e}" for e in range(experts)])
    split = ExpertSplit(experts, tp, dp, expert_parallel=True, placement=placement)
    seen: list[int] = []
    for moe_rank in range(tp * dp):
        held = split.experts(moe_rank)
        seen += held
        blocks, shape = expert_stack_blocks(w13, shapes, split, moe_rank)
        assert shape == (len(held), 2 * inter, hidden)
        assert blocks == tuple(Block(name, (0, inter)) for e in held for name in (f"g{e}", f"u{e}"))
        blocks, shape = expert_stack_blocks(w2, shapes, split, moe_rank)
        assert shape == (len(held), hidden, inter)
        assert blocks == tuple(Block(f"d{e}", (0, hidden), (0, inter)) for e in held)
    assert sorted(seen) == list(range(experts))  # every expert on exactly one rank


def test_expert_stack_bad_input() -> None:
    shapes = _stack_shapes(4, 6, 4)
    w13 = w13_pieces([(f"g{e}", f"u{e}") for e in range(4)])
    with pytest.raises(PlanError, match="g0 has 6 rows, not divisible by 4"):
        expert_stack_blocks(w13, shapes, ExpertSplit(4, 2, 2), 0)
    with pytest.raises(PlanError, match="MoE rank 4 of 5 would hold none of the 4 experts"):
        expert_stack_blocks(w13, shapes, ExpertSplit(4, 5, expert_parallel=True), 4)
    with pytest.raises(PlanError, match="expert 3 has no tensor in this stack"):
        expert_stack_blocks(w13[:-2], shapes, ExpertSplit(4, 2), 1)
    uneven = {**shapes, "g2": (8, 4), "u2": (8, 4)}
    with pytest.raises(PlanError, match="do not all have the same shape"):
        expert_stack_blocks(w13, uneven, ExpertSplit(4, 2), 0)


def scale_piece(shape: tuple[int, int], cut: Cut, block: tuple[int, int]) -> Piece:
    return Piece("w.weight_scale_inv", Cut.BLOCK_SCALE, scale_of=ScaleOf(shape, cut, block))


@pytest.mark.parametrize(
    ("shape", "cut", "block", "tp", "expected"),
    [
        # column-parallel 384 x 200 in 128 x 128 blocks at tp3: one row of scales each,
        # every column (the last column block is partial: 200 = 128 + 72)
        ((384, 200), Cut.ROWS, (128, 128), 3, [((r, r + 1), (0, 2)) for r in range(3)]),
        # row-parallel 96 x 384 in 32 x 64 blocks at tp2: 3 rows, 3 of the 6 column blocks
        ((96, 384), Cut.COLS, (32, 64), 2, [((0, 3), (0, 3)), ((0, 3), (3, 6))]),
        # replicated 192 x 130: a partial last block either way, whole on every rank
        ((192, 130), Cut.REPLICATE, (128, 128), 2, [((0, 2), (0, 2))] * 2),
        # tp1 keeps the partial blocks of a split kind
        ((200, 72), Cut.ROWS, (128, 128), 1, [((0, 2), (0, 1))]),
    ],
)
def test_block_scales_follow_the_weight_in_whole_blocks(
    shape: tuple[int, int],
    cut: Cut,
    block: tuple[int, int],
    tp: int,
    expected: list[tuple[tuple[int, int], tuple[int, int]]],
) -> None:
    piece = scale_piece(shape, cut, block)
    scale_shape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    got = [piece_blocks(piece, scale_shape, tp, rank) for rank in range(tp)]
    assert got == [(Block("w.weight_scale_inv", rows, cols),) for rows, cols in expected]


def test_a_rank_starting_inside_a_block_has_no_scales() -> None:
    piece = scale_piece((192, 128), Cut.ROWS, (128, 128))
    assert piece_blocks(piece, (2, 1), 2, 0) == (Block("w.weight_scale_inv", (0, 1), (0, 1)),)
    with pytest.raises(PlanError, match="rows start at 96, inside a block of 128"):
        piece_blocks(piece, (2, 1), 2, 1)
