"""The cuts a manifest names: how each piece of a parameter is cut from its source, as
`shardprep.plan.cuts.Cut` spells them, and the MXFP4 constants the records need."""

from __future__ import annotations

# The ways a piece of a parameter is cut from its source (`shardprep.plan.cuts.Cut`).
CUTS: tuple[str, ...] = (
    "replicate", "rows", "cols", "kv_heads", "vocab", "padded_vocab", "block_scale", "packed",
)  # fmt: skip
# ... of a source whose dim 0 is the experts (gpt-oss's fused expert tensors).
CUTS += ("expert_cols_t", "expert_rows_t", "expert_row", "expert_row_first")
# ... and MXFP4 experts, unpadded or (with a `scale_of.grid`) in a parameter padded as
# one MoE backend pads it.
MX_CUTS = ("mx_w13", "mx_w2", "mx_w13_bias", "mx_w2_bias")
MXFP4_PADDING_AT_LOAD = "at_load"  # the experts' `mxfp4_padding` of unpadded stacks
MX_BLOCK = 32  # MXFP4 values that share one scale
CUTS += MX_CUTS
# ... of a source that stacks `heads` equal parts (a fused q, k, v), each split evenly.
CUTS += ("parts_rows",)
# ... of a tensor whose rows are q, k and v parts, each split evenly (a DeltaNet's conv1d).
CUTS += ("qkv_rows",)
# ... of a fused GQA q, k, v: the rank's query heads' rows and its KV heads' (replicated
# where tp exceeds them), given the query heads (`q_heads`) and the KV heads (`heads`).
CUTS += ("qkv_heads",)
# ... of a per-tensor scale, one value per part of a fused layer (fp8 per tensor), and of
# one value held 0-d (a KV-cache scale).
CUTS += ("per_tensor", "scalar")
# ... and one value of an expert (an NVFP4 global scale), stacked into a vector.
CUTS += ("expert_scalar",)
# ... and zero rows that a fused layer pads its output with, read from no source: up to
# a multiple of rows (or, as artifacts recorded it before, a count for their tp alone:
# those serve only their own topology, so nothing cuts them again).
CUTS += ("align_rows", "zero_rows")
# ... of an expert stack stored as vLLM stacks it (transformers 5's fused experts).
CUTS += ("expert_halves_rows", "expert_cols")
