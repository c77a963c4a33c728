from __future__ import annotations

import pytest

from shardprep.errors import PlanError
from shardprep.layout import Block, Cut, Piece, block_shape, piece_blocks


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


def test_divisibility_is_checked() -> None:
    with pytest.raises(PlanError, match="q has 10 rows, not divisible by 4"):
        piece_blocks(Piece("q", Cut.ROWS), (10, 4), 4, 0)
    with pytest.raises(PlanError, match="a column split needs 2-D"):
        piece_blocks(Piece("b", Cut.COLS), (10,), 2, 0)


def test_replicated_scalar_and_vector() -> None:
    assert piece_blocks(Piece("n", Cut.REPLICATE), (7,), 4, 3) == (Block("n", (0, 7)),)
    assert block_shape(Block("s", (0, 1)), ()) == ()
