"""Kimi-K3 (`KimiK3ForConditionalGeneration`, vLLM's `models/kimi_k3/nvidia/model.py`,
`kda.py` and `mla.py`): a Kimi-Linear text model under `language_model.` and a
MoonViT-3D vision tower.

Each decoder layer is Kimi Delta Attention (KDA) when its 1-based index is in
`linear_attn_config.kda_layers`, MLA otherwise; layer `i` holds experts when
`i >= first_k_dense_replace` and `i % moe_layer_freq == 0` (`block_sparse_moe.`), a dense
MLP (`mlp.`) otherwise. vLLM names every parameter as the checkpoint does, under
`language_model.model.` (its mapper also accepts `language_model.layers.`).

- KDA (`KimiK3DeltaAttention`, full-rank gate only): `q_proj`, `k_proj`, `v_proj`,
  `g_proj`, `f_a_proj` and `b_proj` fuse into `in_proj_qkvgfab`: the rank's rows of q, k,
  v and g, the whole `f_a_proj` (replicated), the rank's `b_proj` rows (one per head),
  then zero rows that pad the rank's output to a multiple of 16 (never loaded);
  `q_conv1d`, `k_conv1d`, `v_conv1d` fuse into a float32 `conv1d` [3P/tp, 1, kernel]
  (the rank's rows of each); `f_b_proj` by rows; `dt_bias` (float32) and `A_log`
  (float32, one per head) by rows; `o_norm` whole; `o_proj` by columns.
- MLA with the output gate: `q_a_proj` and `kv_a_proj_with_mqa` (whole) and `g_proj`
  (the rank's rows) fuse into `fused_qkv_a_g_proj`; `q_b_proj`, `kv_b_proj` by rows
  (whole heads), `o_proj` by columns, the two layernorms whole. Without the gate,
  DeepSeek's replicated `fused_qkv_a_proj`.
- MoE (latent experts): router `gate.weight` whole, `gate.e_score_correction_bias`
  float32; shared experts as a dense MLP of `num_shared_experts x moe_intermediate_size`;
  `routed_expert_down_proj` [latent, H], `routed_expert_norm`, `routed_expert_up_proj`
  [H, latent] whole; the experts (`experts.{e}.w1/w3/w2`) as FusedMoE stacks over the
  latent width (published in MXFP4: kimi_k3_quant.py). vLLM zero-pads the experts'
  intermediate per rank to `min_moe_intermediate_per_partition` (default 256) when tp
  splits it finer; shardprep does not write that padded layout and refuses such a tp.
- Attention residuals (`attn_res_block_size`): per layer `self_attention_res_norm`,
  `mlp_res_norm` and the [1, H] projections `self_attention_res_proj`, `mlp_res_proj`,
  whole; on the last stage `output_attn_res_norm` and `output_attn_res_proj`.

Text layers from num_hidden_layers on are MTP layers, which vLLM loads only as the `mtp`
draft (mtp.py).

vLLM puts the embedding on the first stage (and on the last too for a DSpark draft at
pp > 1, `dspark.py`), the final norm and lm_head on the last.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Count,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_count,
    expert_parallel_problems,
)
from shardprep.plan.archs.kimi_k3.dspark import ARCHITECTURE as DSPARK
from shardprep.plan.archs.kimi_k3.quant import quant_scheme, quantized_weights
from shardprep.plan.archs.kimi_k3.text import (
    EMBED,
    HEAD,
    MODEL,
    NORM,
    OUT_RES,
    K3Dims,
    text_config,
)
from shardprep.plan.archs.kimi_k3.vision import VisionTower
from shardprep.plan.archs.parts.mla import fused_params
from shardprep.plan.archs.parts.mtp import MTP_LAYERS, mtp_layers
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant import Scheme
from shardprep.plan.topology import Topology


class KimiK3Family(Family):
    name = "kimi_k3"
    label = "Kimi-K3"
    builtin_draft = MTP_LAYERS
    accepted_drafts: ClassVar[Mapping[str, str]] = {
        "dspark": f"its DSpark draft ({DSPARK}, --draft-method dspark)",
        "mtp": "the MTP layers of its checkpoint",
    }
    draft_embedding = EMBED  # for its DSpark draft at pp > 1
    quant_schemes = frozenset({"mxfp4_pack"})  # as published: MXFP4 routed experts
    expert_parallel_refusal = (
        "expert parallelism is not supported for Kimi-K3 yet: vLLM then runs its experts "
        "and shared experts in a layout shardprep does not write"
    )

    def read_config(self, config: Config) -> dict[str, Any]:
        return text_config(config)

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        """The MTP layers (index >= num_hidden_layers)."""
        d = K3Dims.of(config)
        return [name for name in shapes if d.beyond_layers(name)]

    def internal_draft(self, config: Config) -> str | None:
        """vLLM serves the MTP layers (`num_nextn_predict_layers`) as the `mtp` draft
        (`KimiK3MTPModel`, kimi_k3_mtp.py)."""
        text = text_config(config) if "text_config" in config else config
        return "mtp" if config_count(text, "num_nextn_predict_layers") else None

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The experts, and the MTP layers (one tensor each at least: the target's own
        checkpoint may leave them out)."""
        d, vision = K3Dims.counted(config), VisionTower.of(config).layers
        mtp = mtp_layers(config)
        experts, _ = d.counts(mtp)
        return [
            experts,
            Count("num_nextn_predict_layers", len(mtp), len(mtp)),
            Count("vision_config.vt_num_hidden_layers", vision, vision),
        ]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        text = {name: shape for name, (shape, _) in K3Dims.of(config).sources().items()}
        return text | VisionTower.of(config).shapes()

    def source_dtypes(self, config: Config) -> dict[str, str]:
        return {name: dtype for name, (_, dtype) in K3Dims.of(config).sources().items() if dtype}

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        d = K3Dims.of(config)
        return quantized_weights(filter(d.is_moe, range(d.layers)), d.experts, MODEL)

    def quant_scheme(self, scheme: Scheme) -> Scheme:
        return quant_scheme(scheme)

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        try:
            d = K3Dims.of(config)
        except (KeyError, ValueError, TypeError):
            return []  # expected_shapes reports what config.json lacks
        problems = d.problems(tp)
        if config.get("tie_word_embeddings"):
            problems.append("tie_word_embeddings is not supported for Kimi-K3 models")
        problems += expert_parallel_problems(self, ctx)
        return problems + VisionTower.of(config).problems(tp)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d = K3Dims.of(config)
        last = topology.last_stage
        params: list[Param] = []
        for layer in range(d.layers):
            params += fused_params(d.layer_params(layer), topology.stage_of_layer(layer))
        params.append(Param(EMBED, (Piece(EMBED, Cut.VOCAB),), (0,)))
        params.append(Param(NORM, (Piece(NORM, Cut.REPLICATE),), (last,)))
        params.append(Param(HEAD, (Piece(HEAD, Cut.VOCAB),), (last,)))
        if d.attn_res:
            params += [Param(name, (Piece(name, Cut.REPLICATE),), (last,)) for name in OUT_RES]
        params += VisionTower.of(config).params(topology.tp, tuple(range(topology.pp)))
        return Layout(tuple(params), num_experts=d.experts)

    def after_fill(self, model: Any, filled: set[str]) -> None:
        """What the KDA layers' weight loaders do besides copying: when vLLM chose a fused
        decode kernel (not on the CPU build) it keeps a [3, kernel, P/tp] copy of each of
        the q, k, v parts of `conv1d` (`decode_conv1d_weight`) and a float32 copy of
        `o_norm` (`decode_norm_weight`), filled as the weights load."""
        for module in model.modules():
            conv = getattr(module, "decode_conv1d_weight", None)
            if conv is not None:
                weight = module.conv1d.weight
                part = weight.shape[0] // 3
                for i in range(3):
                    conv[i].copy_(weight[i * part : (i + 1) * part].squeeze(1).transpose(0, 1))
            norm = getattr(module, "decode_norm_weight", None)
            if norm is not None:
                norm.copy_(module.o_norm.weight)
