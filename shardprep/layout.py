"""How one vLLM parameter of one tensor-parallel rank is cut from source tensors.

A parameter is a concatenation along dim 0 of pieces, one per source tensor (a fused
`qkv_proj` has three). Each piece says how its source is cut across ranks. Everything
here is pure arithmetic on shapes, so a plan can be made and tested without a byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shardprep.errors import PlanError
from shardprep.topology import kv_heads_of_rank, pad_vocab, rank_range


class Cut(Enum):
    REPLICATE = "replicate"  # every rank holds the whole tensor
    ROWS = "rows"  # column-parallel: dim 0 split evenly
    COLS = "cols"  # row-parallel: dim 1 split evenly
    KV_HEADS = "kv_heads"  # dim 0 in heads; replicated when tp exceeds the heads
    VOCAB = "vocab"  # dim 0 padded to a multiple of 64, split, padding zero-filled
    PADDED_VOCAB = "padded_vocab"  # dim 0 padded to a multiple of 64, not split


@dataclass(frozen=True)
class Piece:
    source: str
    cut: Cut
    heads: int = 0  # number of KV heads, for Cut.KV_HEADS


@dataclass(frozen=True)
class Block:
    """Rows [start, end) of a source tensor (and columns, for row-parallel weights), or
    `end - start` zero rows when `source` is None."""

    source: str | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None


def piece_blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    """The blocks that rank `rank` of `tp` takes from a source tensor of `shape`."""
    rows = shape[0] if shape else 1
    if piece.cut is Cut.REPLICATE:
        return (Block(piece.source, (0, rows)),)
    if piece.cut is Cut.ROWS:
        _check_divisible(piece.source, rows, tp, "rows")
        return (Block(piece.source, rank_range(rows, tp, rank)),)
    if piece.cut is Cut.COLS:
        if len(shape) != 2:
            raise PlanError(f"{piece.source} has shape {list(shape)}; a column split needs 2-D")
        _check_divisible(piece.source, shape[1], tp, "columns")
        return (Block(piece.source, (0, rows), rank_range(shape[1], tp, rank)),)
    if piece.cut is Cut.KV_HEADS:
        _check_divisible(piece.source, rows, piece.heads, "rows per KV head")
        head_rows = rows // piece.heads
        first, end = kv_heads_of_rank(piece.heads, tp, rank)
        return (Block(piece.source, (first * head_rows, end * head_rows)),)
    if piece.cut is Cut.PADDED_VOCAB:
        return _vocab_blocks(piece.source, rows, 1, 0)
    return _vocab_blocks(piece.source, rows, tp, rank)


def _vocab_blocks(source: str, vocab: int, tp: int, rank: int) -> tuple[Block, ...]:
    padded = pad_vocab(vocab)
    _check_divisible(source, padded, tp, "rows once the vocabulary is padded to 64")
    start, end = rank_range(padded, tp, rank)
    real = (min(start, vocab), min(end, vocab))
    blocks = []
    if real[1] > real[0]:
        blocks.append(Block(source, real))
    if end - start > real[1] - real[0]:
        blocks.append(Block(None, (0, end - start - (real[1] - real[0]))))
    return tuple(blocks)


def block_shape(block: Block, source_shape: tuple[int, ...]) -> tuple[int, ...]:
    rows = block.rows[1] - block.rows[0]
    if block.cols is not None:
        return (rows, block.cols[1] - block.cols[0])
    return (rows, *source_shape[1:]) if source_shape else ()


def _check_divisible(source: str, size: int, tp: int, what: str) -> None:
    if size % tp:
        raise PlanError(
            f"{source} has {size} {what}, not divisible by {tp}; choose a tp that divides it"
        )
