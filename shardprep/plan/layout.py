"""How one vLLM parameter of one tensor-parallel rank is cut from source tensors.

A parameter is a concatenation along dim 0 of pieces, one per source tensor (a fused
`qkv_proj` has three). Each piece says how its source is cut across ranks. Everything
here is pure arithmetic on shapes, so a plan can be made and tested without a byte.

An expert stack (FusedMoE's `w13_weight` [E_local, 2I/tp, H], `w2_weight`
[E_local, H, I/tp]) is the same: its pieces carry the global expert id, a MoE rank keeps
the pieces of the experts it holds, and a row-major [E, R, C] tensor has the bytes of
the dim-0 concatenation of its [R, C] blocks; only the final shape differs. A checkpoint
that stores a layer's experts fused in one tensor (dim 0 the expert) is cut by the
`EXPERT_*` cuts: a piece names its expert, whose row of the source it reads (gpt-oss's
[E, H, 2I] `gate_up_proj` is also transposed to vLLM's [2I/tp, H] per expert).
"""

from __future__ import annotations

import functools

from shardprep.errors import PlanError
from shardprep.plan.cuts import (
    EXPERT_INDEXED,
    EXPERT_MATRICES,
    MX_BLOCK,
    MX_CUTS,
    Block,
    Cut,
    Piece,
    ScaleOf,
)
from shardprep.plan.topology import kv_heads_of_rank, pad_vocab, rank_range


def piece_blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    """The blocks that rank `rank` of `tp` takes from a source tensor of `shape`.

    The geometry depends on the cut and the shape only, so it is computed once for all
    the tensors that share them (hundreds of experts per layer); a problem is reported
    under the tensor's own name. An `EXPERT_*` cut reads its expert's row of the source."""
    return placed_blocks(piece, shape, piece_geometry(piece, shape, tp, rank))


def piece_geometry(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    """The blocks of `piece_blocks` before they are given the piece's source and moved to
    its expert: the same for every piece of the same cut, heads, scale and shape."""
    anonymous = Piece("", piece.cut, piece.heads, scale_of=piece.scale_of, q_heads=piece.q_heads)
    try:
        return _cached_blocks(anonymous, tuple(shape), tp, rank)
    except PlanError:
        return _blocks(piece, shape, tp, rank)


def placed_blocks(
    piece: Piece, shape: tuple[int, ...], geometry: tuple[Block, ...]
) -> tuple[Block, ...]:
    """`piece_geometry`'s blocks read from the piece's source (its expert's row of it,
    for an `EXPERT_*` cut)."""
    shift = check_expert_row(piece, shape)
    source = piece.source
    if len(geometry) == 1:  # most cuts: one block, made without a generator
        (b,) = geometry
        if b.source is None:
            return geometry
        rows = (b.rows[0] + shift, b.rows[1] + shift)
        return (Block(source, rows, b.cols, b.repeat, b.matrix, b.slab),)
    return tuple(
        Block(source, (b.rows[0] + shift, b.rows[1] + shift), b.cols, b.repeat, b.matrix, b.slab)
        if b.source is not None
        else b
        for b in geometry
    )


def check_expert_row(piece: Piece, shape: tuple[int, ...]) -> int:
    """The row of its source an `EXPERT_*` piece reads (its expert's), which must exist;
    0 for other cuts."""
    shift = (piece.expert or 0) if piece.cut in EXPERT_INDEXED else 0
    if shift and shift >= shape[0]:
        raise PlanError(f"{piece.source} holds {shape[0]} experts, not expert {shift}")
    return shift


@functools.lru_cache(maxsize=4096)
def _cached_blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    return _blocks(piece, shape, tp, rank)


def _blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    rows = shape[0] if shape else 1
    if piece.cut in (Cut.REPLICATE, Cut.EXPERT_SCALAR):
        return (Block(piece.source, (0, rows)),)
    if piece.cut in (Cut.PER_TENSOR, Cut.SCALAR):
        if rows != 1 or len(shape) > 1:
            raise PlanError(
                f"{piece.source} has shape {list(shape)}; a per-tensor scale is one value"
            )
        return (Block(piece.source, (0, 1)),)
    if piece.cut is Cut.ROWS:
        _check_divisible(piece.source, rows, tp, "rows")
        return (Block(piece.source, rank_range(rows, tp, rank)),)
    if piece.cut is Cut.COLS:
        if len(shape) != 2:
            raise PlanError(f"{piece.source} has shape {list(shape)}; a column split needs 2-D")
        _check_divisible(piece.source, shape[1], tp, "columns")
        return (Block(piece.source, (0, rows), rank_range(shape[1], tp, rank)),)
    if piece.cut is Cut.BLOCK_SCALE:
        assert piece.scale_of is not None
        return (_scale_block(piece.source, piece.scale_of, tp, rank),)
    if piece.cut is Cut.PACKED:
        assert piece.scale_of is not None
        return (_packed_block(piece.source, piece.scale_of, tp, rank),)
    if piece.cut is Cut.KV_HEADS:
        _check_divisible(piece.source, rows, piece.heads, "rows per KV head")
        head_rows = rows // piece.heads
        first, end = kv_heads_of_rank(piece.heads, tp, rank)
        return (Block(piece.source, (first * head_rows, end * head_rows)),)
    if piece.cut is Cut.PARTS_ROWS:
        _check_divisible(piece.source, rows, piece.heads, "rows")
        part = rows // piece.heads
        _check_divisible(piece.source, part, tp, f"rows in each of its {piece.heads} parts")
        start, end = rank_range(part, tp, rank)
        return tuple(
            Block(piece.source, (i * part + start, i * part + end)) for i in range(piece.heads)
        )
    if piece.cut is Cut.QKV_ROWS:
        return _qkv_blocks(piece.source, rows, piece.heads, tp, rank)
    if piece.cut is Cut.QKV_HEADS:
        return _qkv_head_blocks(piece.source, rows, piece.q_heads, piece.heads, tp, rank)
    if piece.cut is Cut.PADDED_VOCAB:
        return _vocab_blocks(piece.source, rows, 1, 0)
    if piece.cut in MX_CUTS:
        return (_mx_block(piece, shape, tp, rank),)
    if piece.cut in EXPERT_MATRICES:
        return _expert_matrix_blocks(piece, shape, tp, rank)
    if piece.cut in EXPERT_INDEXED:
        return (_expert_block(piece, shape, tp, rank),)
    return _vocab_blocks(piece.source, rows, tp, rank)


def _expert_block(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> Block:
    """Expert 0's block of an `EXPERT_*` cut (`piece_blocks` moves it to the piece's)."""
    dims = 3 if piece.cut in (Cut.EXPERT_COLS_T, Cut.EXPERT_ROWS_T) else 2
    if len(shape) != dims:
        raise PlanError(
            f"{piece.source} has shape {list(shape)}; its cut ({piece.cut.value}) needs "
            f"{dims} dimensions, the first one the experts"
        )
    if piece.cut is Cut.EXPERT_ROW_FIRST:
        return Block(piece.source, (0, 1)) if rank == 0 else Block(None, (0, 1))
    if piece.cut is Cut.EXPERT_ROW:
        _check_divisible(piece.source, shape[1], tp, "values per expert")
        return Block(piece.source, (0, 1), rank_range(shape[1], tp, rank))
    rows, cols = (0, shape[1]), (0, shape[2])
    if piece.cut is Cut.EXPERT_COLS_T:
        _check_divisible(piece.source, shape[2], tp, "columns per expert")
        cols = rank_range(shape[2], tp, rank)
    else:
        _check_divisible(piece.source, shape[1], tp, "rows per expert")
        rows = rank_range(shape[1], tp, rank)
    return Block(piece.source, (0, 1), matrix=(rows, cols))


def _expert_matrix_blocks(
    piece: Piece, shape: tuple[int, ...], tp: int, rank: int
) -> tuple[Block, ...]:
    """Expert 0's blocks of an `EXPERT_HALVES_ROWS` or `EXPERT_COLS` cut: parts of its
    [A, B] matrix, not transposed (`Block.slab` with no padding)."""
    if len(shape) != 3:
        raise PlanError(
            f"{piece.source} has shape {list(shape)}; its cut ({piece.cut.value}) needs "
            "3 dimensions, the first one the experts"
        )
    a, b = shape[1], shape[2]
    if piece.cut is Cut.EXPERT_COLS:
        _check_divisible(piece.source, b, tp, "columns per expert")
        start, end = rank_range(b, tp, rank)
        return (Block(piece.source, (0, 1), slab=((0, a), (start, end), (a, end - start))),)
    _check_divisible(piece.source, a, 2 * tp, "rows per expert (two halves)")
    start, end = rank_range(a // 2, tp, rank)
    return tuple(
        Block(piece.source, (0, 1), slab=((h + start, h + end), (0, b), (end - start, b)))
        for h in (0, a // 2)
    )


def mx_range(intermediate: int, tp: int, rank: int) -> tuple[int, int]:
    """The intermediate rows [start, end) rank `rank` of `tp` loads of MXFP4 experts:
    vLLM's `_load_weights_mxfp4` gives every rank ceil(I/32 / tp) whole 32-blocks, the
    last ones what is left (possibly nothing)."""
    per_rank = -(-(intermediate // MX_BLOCK) // tp) * MX_BLOCK
    start = min(rank * per_rank, intermediate)
    return start, min(start + per_rank, intermediate)


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _mx_block(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> Block:
    """Expert 0's slab of an MXFP4 cut; `scale_of` holds the expert's logical [rows,
    cols] (w13: [2I, H]; w2: [H, I]; biases: [1, 2I] and [1, H]), the values to a stored
    element along the columns (`block[1]`) and the alignments of the intermediate and
    hidden sizes a backend's padding baked in (`grid`; None: the rank's blocks alone,
    which the loader pads at load for the backend that runs)."""
    of = piece.scale_of
    assert of is not None
    per = of.block[1]
    want = 2 + (piece.cut in (Cut.MX_W13, Cut.MX_W2))
    if len(shape) < want:
        raise PlanError(
            f"{piece.source} has shape {list(shape)}; its cut ({piece.cut.value}) needs at "
            f"least {want} dimensions, the first one the experts"
        )
    if piece.cut is Cut.MX_W13:
        inter, hidden = of.shape[0] // 2, of.shape[1]
    elif piece.cut is Cut.MX_W13_BIAS:
        inter, hidden = of.shape[1] // 2, 0
    elif piece.cut is Cut.MX_W2:
        hidden, inter = of.shape
    else:
        hidden, inter = of.shape[1], 0
    start, end = mx_range(inter, tp, rank)
    local, padded_hidden = end - start, hidden
    if of.grid is not None:  # a backend's padded per-rank size
        local, padded_hidden = round_up(inter // tp, of.grid[0]), round_up(hidden, of.grid[1])
    if piece.cut is Cut.MX_W13:
        cols = padded_hidden // per
        slab = ((2 * start, 2 * end), (0, hidden // per), (2 * local, cols))
    elif piece.cut is Cut.MX_W13_BIAS:
        slab = ((0, 1), (2 * start, 2 * end), (1, 2 * local))
    elif piece.cut is Cut.MX_W2:
        slab = ((0, hidden), (start // per, end // per), (padded_hidden, local // per))
    else:
        slab = ((0, 1), (0, hidden if rank == 0 else 0), (1, padded_hidden))
    return Block(piece.source, (0, 1), slab=slab)


def _qkv_blocks(source: str, rows: int, qk: int, tp: int, rank: int) -> tuple[Block, ...]:
    """The rank's q rows, k rows and v rows of a tensor whose dim 0 is q (`qk` rows), k
    (`qk` rows) and v (the rest)."""
    if not 0 < 2 * qk < rows:
        raise PlanError(
            f"{source} has {rows} rows, which cannot hold q and k rows of {qk} each and v "
            "rows; the checkpoint does not match config.json"
        )
    blocks = []
    start = 0
    for what, size in (("q rows", qk), ("k rows", qk), ("v rows", rows - 2 * qk)):
        _check_divisible(source, size, tp, what)
        first, end = rank_range(size, tp, rank)
        blocks.append(Block(source, (start + first, start + end)))
        start += size
    return tuple(blocks)


def _qkv_head_blocks(
    source: str, rows: int, q_heads: int, kv_heads: int, tp: int, rank: int
) -> tuple[Block, ...]:
    """The rank's q rows, then the k rows and the v rows of its KV heads, of a tensor whose
    dim 0 is `q_heads` query heads, then `kv_heads` key heads and as many value heads."""
    heads = q_heads + 2 * kv_heads
    if q_heads < 1 or kv_heads < 1 or rows % heads:
        raise PlanError(
            f"{source} has {rows} rows, not {q_heads} query heads and {kv_heads} key and "
            "value heads each of one size; the checkpoint does not match config.json"
        )
    size = rows // heads
    _check_divisible(source, q_heads, tp, "query heads")
    q = rank_range(q_heads * size, tp, rank)
    first, end = kv_heads_of_rank(kv_heads, tp, rank)
    k = (q_heads + first) * size, (q_heads + end) * size
    v = k[0] + kv_heads * size, k[1] + kv_heads * size
    return Block(source, q), Block(source, k), Block(source, v)


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


def _scale_block(source: str, of: ScaleOf, tp: int, rank: int) -> Block:
    """The scale rows (and columns) of the weight blocks that rank `rank` holds, as vLLM's
    `BlockQuantScaleParameter` narrows them: ceil(local size / block) scales, starting at
    the rank's first block. A rank whose slice starts inside a block has no scales of
    its own; vLLM refuses that topology (`validate_fp8_block_shape`), and so does this."""
    grid = of.grid or of.block
    repeat = (of.block[0] // grid[0], of.block[1] // grid[1])
    (cut,) = piece_blocks(Piece(source, of.cut, of.heads), of.shape, tp, rank)
    rows = _in_blocks(source, cut.rows, grid[0], "rows")
    if cut.cols is None:
        return Block(source, rows, (0, -(-of.shape[1] // grid[1])), repeat)
    return Block(source, rows, _in_blocks(source, cut.cols, grid[1], "columns"), repeat)


def _packed_block(source: str, of: ScaleOf, tp: int, rank: int) -> Block:
    """The elements of a packed tensor that hold the rank's part of the weight: its rows,
    and the columns of its column range, `of.block[1]` to an element (vLLM's
    `PackedvLLMParameter` and group scales narrow them so). A rank whose columns start
    inside an element has none of its own: refused, as vLLM refuses that tp."""
    (cut,) = piece_blocks(Piece(source, of.cut, of.heads), of.shape, tp, rank)
    per = of.block[1]
    if cut.cols is None:  # every column: whole rows of the stored tensor
        return Block(source, cut.rows)
    return Block(source, cut.rows, _in_blocks(source, cut.cols, per, "columns", "packed element"))


def _in_blocks(
    source: str, span: tuple[int, int], block: int, what: str, unit: str = "block"
) -> tuple[int, int]:
    if span[0] % block:
        raise PlanError(
            f"{source}: a rank's {what} start at {span[0]}, inside a {unit} of {block}; "
            f"choose a tp whose per-rank size is a whole number of {unit}s"
        )
    return span[0] // block, -(-span[1] // block)


def block_shape(block: Block, source_shape: tuple[int, ...]) -> tuple[int, ...]:
    rows = block.rows[1] - block.rows[0]
    if block.slab is not None:
        return (block.height, block.slab[2][1])
    if block.matrix is not None:
        return (block.height, block.matrix[0][1] - block.matrix[0][0])
    if block.cols is not None:
        return (rows, block.cols[1] - block.cols[0])
    return (rows, *source_shape[1:]) if source_shape else ()


def _check_divisible(source: str, size: int, tp: int, what: str) -> None:
    if size % tp:
        raise PlanError(
            f"{source} has {size} {what}, not divisible by {tp}; choose a tp that divides it"
        )
