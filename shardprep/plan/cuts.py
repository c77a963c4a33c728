"""What a cut is: how one source tensor's part of a vLLM parameter is cut across ranks
(`Cut`), a piece of a parameter (`Piece`), and the block of a source a rank reads
(`Block`). How each cut applies to a shape is layout.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from shardprep.errors import PlanError

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
    # dim 0 is q (`q_heads` heads), then k and v (the piece's `heads` KV heads each), all
    # of one head size: a rank holds its q rows, then the k rows and the v rows of its KV
    # heads, replicated where tp exceeds them (vLLM's QKVParallelLinear given a fused GQA
    # qkv, Phi-3-medium's `qkv_proj`)
    QKV_HEADS = "qkv_heads"
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
    # (the last rank may hold fewer, or none), unpadded (the loader pads them for the
    # backend that runs) or in the top-left corner of a parameter a backend's padding
    # baked in (`scale_of.grid`: its intermediate and hidden alignments).
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
    # Zero rows of the source's width up to a multiple of `heads` rows of the parameter
    # so far, on every rank: rows a fused layer pads each rank's output with and never
    # loads (Kimi-K3's `in_proj_qkvgfab`); nothing of the source is read.
    ALIGN_ROWS = "align_rows"

    # Enum's own hash runs in Python; members are singletons, so identity hashes alike,
    # in C: a flagship's plan hashes cuts millions of times (in pieces, kinds, sets).
    __hash__ = object.__hash__


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


class ScaleOf(NamedTuple):
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


def matrix(shape: Sequence[int], source: str) -> tuple[int, int]:
    """(rows, cols) of the weight `source`, whose scales a `ScaleOf` describes: 2-D."""
    if len(shape) != 2:
        raise PlanError(f"{source} has shape {list(shape)}: a quantized weight must be 2-D")
    return shape[0], shape[1]


class Piece(NamedTuple):
    """A part of a parameter: the source tensor and how each rank cuts it. A named tuple,
    not a dataclass: a flagship's plan makes a million, and a tuple is made twice as fast."""

    source: str
    cut: Cut
    heads: int = 0  # KV heads (KV_HEADS, QKV_HEADS); parts (PARTS_ROWS); rows of q (QKV_ROWS)
    expert: int | None = None  # global expert id, for a piece of an expert stack
    scale_of: ScaleOf | None = None  # for Cut.BLOCK_SCALE and Cut.PACKED
    q_heads: int = 0  # query heads (QKV_HEADS)


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
