"""The cuts of a source that holds a layer's experts fused in one tensor, dim 0 the expert
(gpt-oss's `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H] and their biases): each
piece reads its expert's row; matrices are transposed as vLLM transposes them. Odd sizes
(tp3, 5 experts) so that a wrong range shows."""

from __future__ import annotations

import pytest

from shardprep.errors import PlanError
from shardprep.plan.cuts import Block, Cut, Piece
from shardprep.plan.experts import expert_stack_blocks
from shardprep.plan.layout import block_shape, piece_blocks
from shardprep.plan.topology import ExpertSplit


def stack(source: str, cut: Cut, experts: int) -> tuple[Piece, ...]:
    return tuple(Piece(source, cut, expert=e) for e in range(experts))


def test_columns_of_each_experts_matrix_are_split_and_transposed() -> None:
    # [5 experts, A=7, B=12] at tp3: rank 1 holds columns 4-7 of expert 2, as 4 rows of 7.
    (block,) = piece_blocks(Piece("g", Cut.EXPERT_COLS_T, expert=2), (5, 7, 12), 3, 1)
    assert block == Block("g", (2, 3), matrix=((0, 7), (4, 8)))
    assert block.height == 4 and block_shape(block, (5, 7, 12)) == (4, 7)


def test_rows_of_each_experts_matrix_are_split_and_transposed() -> None:
    # [5, A=9, B=7] at tp3: rank 2 holds rows 6-8 of expert 4, as 7 rows of 3.
    (block,) = piece_blocks(Piece("d", Cut.EXPERT_ROWS_T, expert=4), (5, 9, 7), 3, 2)
    assert block == Block("d", (4, 5), matrix=((6, 9), (0, 7)))
    assert block.height == 7 and block_shape(block, (5, 9, 7)) == (7, 3)


def test_a_vector_per_expert_is_split_or_whole_on_the_first_rank_only() -> None:
    assert piece_blocks(Piece("b", Cut.EXPERT_ROW, expert=3), (5, 12), 3, 1) == (
        Block("b", (3, 4), (4, 8)),
    )
    first = Piece("c", Cut.EXPERT_ROW_FIRST, expert=3)
    assert piece_blocks(first, (5, 12), 3, 0) == (Block("c", (3, 4)),)
    assert piece_blocks(first, (5, 12), 3, 2) == (Block(None, (0, 1)),)


def test_the_expert_stacks_have_vllms_shapes() -> None:
    split = ExpertSplit(5, 3)
    w13 = stack("g", Cut.EXPERT_COLS_T, 5)
    blocks, shape = expert_stack_blocks(w13, {"g": (5, 7, 12)}, split, 2)
    assert shape == (5, 4, 7)
    assert [b.rows for b in blocks] == [(e, e + 1) for e in range(5)]
    assert {b.matrix for b in blocks} == {((0, 7), (8, 12))}
    _, shape = expert_stack_blocks(stack("d", Cut.EXPERT_ROWS_T, 5), {"d": (5, 9, 7)}, split, 0)
    assert shape == (5, 7, 3)
    _, shape = expert_stack_blocks(stack("b", Cut.EXPERT_ROW, 5), {"b": (5, 12)}, split, 1)
    assert shape == (5, 4)
    zeros, shape = expert_stack_blocks(stack("c", Cut.EXPERT_ROW_FIRST, 5), {"c": (5, 7)}, split, 1)
    assert shape == (5, 7) and {b.source for b in zeros} == {None}


def test_under_expert_parallelism_a_rank_holds_whole_experts_of_its_range() -> None:
    split = ExpertSplit(6, 3, expert_parallel=True)
    blocks, shape = expert_stack_blocks(
        stack("g", Cut.EXPERT_COLS_T, 6), {"g": (6, 7, 12)}, split, 1
    )
    assert shape == (2, 12, 7)
    assert [(b.rows, b.matrix) for b in blocks] == [((e, e + 1), ((0, 7), (0, 12))) for e in (2, 3)]
    first, shape = expert_stack_blocks(stack("c", Cut.EXPERT_ROW_FIRST, 6), {"c": (6, 7)}, split, 2)
    assert shape == (2, 7) and [b.rows for b in first] == [(4, 5), (5, 6)]


def test_a_size_that_tp_does_not_divide_is_refused_naming_the_tensor() -> None:
    with pytest.raises(PlanError, match=r"^g has 10 columns per expert, not divisible by 3"):
        piece_blocks(Piece("g", Cut.EXPERT_COLS_T, expert=0), (5, 7, 10), 3, 0)
    with pytest.raises(PlanError, match=r"^d has 8 rows per expert, not divisible by 3"):
        piece_blocks(Piece("d", Cut.EXPERT_ROWS_T, expert=1), (5, 8, 7), 3, 0)
    with pytest.raises(PlanError, match=r"^b has 10 values per expert, not divisible by 3"):
        piece_blocks(Piece("b", Cut.EXPERT_ROW, expert=1), (5, 10), 3, 0)


def test_a_tensor_without_the_experts_dimension_or_the_expert_is_refused() -> None:
    with pytest.raises(PlanError, match=r"needs 3 dimensions, the first one the experts"):
        piece_blocks(Piece("g", Cut.EXPERT_COLS_T, expert=0), (7, 12), 1, 0)
    with pytest.raises(PlanError, match=r"^g holds 5 experts, not expert 5$"):
        piece_blocks(Piece("g", Cut.EXPERT_COLS_T, expert=5), (5, 7, 12), 1, 0)
