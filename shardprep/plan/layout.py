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
from dataclasses import dataclass
from enum import Enum

from shardprep.errors import PlanError
from shardprep.plan.topology import kv_heads_of_rank, pad_vocab, rank_range

# The dtype of a parameter held in the model's dtype whatever its source's (a Param's
# `dtype`): FusedMoE's int4 `w13_weight_shape`, bf16 [E, 2] from int32 [2] tensors.
MODEL_DTYPE = "model"


class Cut(Enum):
    REPLICATE = "replicate"  # every rank holds the whole tensor
    ROWS = "rows"  # column-parallel: dim 0 split evenly
    COLS = "cols"  # row-parallel: dim 1 split evenly
    KV_HEADS = "kv_heads"  # dim 0 in heads; replicated when tp exceeds the heads
    # dim 0 is `heads` equal parts stacked (a fused q, k, v of as many heads each): the
    # rank's rows of each part, in order (vLLM's QKVParallelLinear given the fused tensor)
    PARTS_ROWS = "parts_rows"
    # dim 0 is q rows, k rows (the piece's `heads` rows each), then v rows, each part
    # split evenly: a rank holds its q rows, then its k rows, then its v rows (a gated
    # DeltaNet's conv1d, vLLM's `mamba_v2_sharded_weight_loader`)
    QKV_ROWS = "qkv_rows"
    VOCAB = "vocab"  # dim 0 padded to a multiple of 64, split, padding zero-filled
    PADDED_VOCAB = "padded_vocab"  # dim 0 padded to a multiple of 64, not split
    BLOCK_SCALE = "block_scale"  # fp8 block scales of a weight: its cut, in whole blocks
    # Cuts of a source whose dim 0 is the expert (the piece's `expert`), per expert:
    EXPERT_COLS_T = "expert_cols_t"  # [A, B]: columns split evenly, transposed to [B/tp, A]
    EXPERT_ROWS_T = "expert_rows_t"  # [A, B]: rows split evenly, transposed to [B, A/tp]
    EXPERT_ROW = "expert_row"  # [B]: split evenly
    EXPERT_ROW_FIRST = "expert_row_first"  # [B]: whole on rank 0, zeros on the others
    # [A, B], not transposed (an expert stack stored as vLLM stacks it, transformers 5's
    # `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]):
    EXPERT_HALVES_ROWS = "expert_halves_rows"  # the rank's rows of each half of A, in order
    EXPERT_COLS = "expert_cols"  # columns split evenly
    # A weight stored `block[1]` columns to an element (int4 values 8 to an int32, group
    # scales one per group): its cut, in whole elements along the columns.
    PACKED = "packed"
    # MXFP4 expert stacks (gpt-oss's `*_blocks`, `*_scales` and the biases beside them), as
    # vLLM's `_load_weights_mxfp4` cuts them: the intermediate split in whole 32-blocks
    # (the last rank may hold fewer), copied into the top-left corner of a parameter the
    # MoE backend padded (`scale_of.grid`: the intermediate and hidden alignments).
    MX_W13 = "mx_w13"  # [E, 2I, H/per]: rows [2s, 2e) of each expert
    MX_W2 = "mx_w2"  # [E, H, I/per]: columns [s/per, e/per) of each expert
    MX_W13_BIAS = "mx_w13_bias"  # [E, 2I]: values [2s, 2e)
    MX_W2_BIAS = "mx_w2_bias"  # [E, H]: whole on rank 0, zeros on the others
    # A per-tensor scale (a scalar or [1]): one value of a parameter holding one per part
    # of a fused layer (fp8 `weight_scale` [parts]), or per expert ([E] or [E, parts]).
    PER_TENSOR = "per_tensor"
    # One value (a scalar or [1]) held as a 0-d parameter (a KV-cache scale), on every rank.
    SCALAR = "scalar"
    # One value of one expert ([1] or [], an NVFP4 global scale), whole on every rank: a
    # stack of them is a vector [experts].
    EXPERT_SCALAR = "expert_scalar"
    # `heads` zero rows of the source's width, on every rank: rows a fused layer pads its
    # output with and never loads (Kimi-K3's `in_proj_qkvgfab`); nothing of the source
    # is read.
    ZERO_ROWS = "zero_rows"


# The cuts that read one row (dim 0) of their source per expert, and those of them whose
# expert stack is [experts, B] (a vector per expert) rather than [experts, rows, cols].
MX_CUTS = frozenset({Cut.MX_W13, Cut.MX_W2, Cut.MX_W13_BIAS, Cut.MX_W2_BIAS})
EXPERT_MATRICES = frozenset({Cut.EXPERT_HALVES_ROWS, Cut.EXPERT_COLS})
EXPERT_INDEXED = (
    frozenset({Cut.EXPERT_COLS_T, Cut.EXPERT_ROWS_T, Cut.EXPERT_ROW, Cut.EXPERT_ROW_FIRST})
    | MX_CUTS
    | EXPERT_MATRICES
)
EXPERT_VECTORS = frozenset(
    {Cut.EXPERT_ROW, Cut.EXPERT_ROW_FIRST, Cut.MX_W13_BIAS, Cut.MX_W2_BIAS, Cut.EXPERT_SCALAR}
)
MX_BLOCK = 32  # values that share one e8m0 scale (OCP MX)


@dataclass(frozen=True)
class ScaleOf:
    """What a block-scale tensor (`weight_scale_inv`) scales, or what a packed tensor
    (`weight_packed`, a group-scale `weight_scale`) stores: a 2-D weight of `shape`, cut by
    `cut` (ROWS, COLS, KV_HEADS of `heads` or REPLICATE), one element per block of
    `block` = (rows, cols) of it."""

    shape: tuple[int, int]
    cut: Cut
    block: tuple[int, int]
    # The finer grid vLLM's parameter uses, when it refines the checkpoint's blocks
    # (fp8 MoE, `refine_fp8_moe_block_shape`): the scales are upsampled to it first.
    grid: tuple[int, int] | None = None
    heads: int = 0


@dataclass(frozen=True)
class Piece:
    source: str
    cut: Cut
    heads: int = 0  # KV heads (KV_HEADS); parts (PARTS_ROWS); rows of q (QKV_ROWS)
    expert: int | None = None  # global expert id, for a piece of an expert stack
    scale_of: ScaleOf | None = None  # for Cut.BLOCK_SCALE and Cut.PACKED


@dataclass(frozen=True, slots=True)
class Block:
    """Rows [start, end) of a source tensor (and columns, for row-parallel weights), or
    `end - start` zero rows when `source` is None."""

    source: str | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    # Rows and columns count in the source upsampled this many times along each dim
    # (every row, then every column, repeated): fp8 MoE scales on a refined block grid.
    repeat: tuple[int, int] = (1, 1)
    # ((rows), (columns)) of the [A, B] matrix that every dim-0 row of a 3-D source is,
    # written transposed: each dim-0 row gives `columns` destination rows of `rows` values.
    matrix: tuple[tuple[int, int], tuple[int, int]] | None = None
    # ((rows), (columns), (height, width)): every dim-0 row of the source, viewed as a
    # matrix of its dim 1 by the rest, gives that part, not transposed, in the top-left
    # corner of a zero [height, width] matrix (MXFP4 experts in a padded parameter).
    slab: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None

    @property
    def height(self) -> int:
        """The destination rows this block fills."""
        rows = self.rows[1] - self.rows[0]
        if self.slab is not None:
            return rows * self.slab[2][0]
        if self.matrix is None:
            return rows
        return rows * (self.matrix[1][1] - self.matrix[1][0])


def piece_blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    """The blocks that rank `rank` of `tp` takes from a source tensor of `shape`.

    The geometry depends on the cut and the shape only, so it is computed once for all
    the tensors that share them (hundreds of experts per layer); a problem is reported
    under the tensor's own name. An `EXPERT_*` cut reads its expert's row of the source."""
    return placed_blocks(piece, shape, piece_geometry(piece, shape, tp, rank))


def piece_geometry(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    """The blocks of `piece_blocks` before they are given the piece's source and moved to
    its expert: the same for every piece of the same cut, heads, scale and shape."""
    anonymous = Piece("", piece.cut, piece.heads, scale_of=piece.scale_of)
    try:
        return _cached_blocks(anonymous, tuple(shape), tp, rank)
    except PlanError:
        return _blocks(piece, shape, tp, rank)


def placed_blocks(
    piece: Piece, shape: tuple[int, ...], geometry: tuple[Block, ...]
) -> tuple[Block, ...]:
    """`piece_geometry`'s blocks read from the piece's source (its expert's row of it,
    for an `EXPERT_*` cut)."""
    shift = (piece.expert or 0) if piece.cut in EXPERT_INDEXED else 0
    if shift and shift >= shape[0]:
        raise PlanError(f"{piece.source} holds {shape[0]} experts, not expert {shift}")
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


@functools.lru_cache(maxsize=4096)
def _cached_blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    return _blocks(piece, shape, tp, rank)


def _blocks(piece: Piece, shape: tuple[int, ...], tp: int, rank: int) -> tuple[Block, ...]:
    rows = shape[0] if shape else 1
    if piece.cut in (Cut.REPLICATE, Cut.EXPERT_SCALAR):
        return (Block(piece.source, (0, rows)),)
    if piece.cut is Cut.ZERO_ROWS:
        return (Block(None, (0, piece.heads)),)
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
    element along the columns (`block[1]`) and the backend's alignments of the
    intermediate and hidden sizes (`grid`)."""
    of = piece.scale_of
    assert of is not None and of.grid is not None
    pad_inter, pad_hidden = of.grid
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
    local = round_up(inter // tp, pad_inter)  # the backend's padded per-rank size
    padded_hidden = round_up(hidden, pad_hidden)
    start, end = mx_range(inter, tp, rank)
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
