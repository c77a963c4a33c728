"""gpt-oss (`GptOssForCausalLM`) in bfloat16, as vLLM's `gpt_oss.py` loads it
(`_load_weights_other`).

vLLM renames `model.embed_tokens` to `model.embedding` and `.self_attn.` to `.attn.`.
Attention is Llama's with biases on q/k/v (`qkv_proj.bias`) and on `o_proj` (whole on
every rank), plus `attn.sinks`, one value per head, split by heads. vLLM splits the KV
heads without replicating them, so tp must divide them. The router `mlp.router` (weight
and bias) is replicated, in the model's dtype.

The Hub stores a layer's experts fused, the expert first:
`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up columns interleaved,
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]. vLLM
keeps the interleaving: rank r of tp takes columns [2rI/tp, 2(r+1)I/tp) of every expert
and transposes them into `w13_weight` [E, 2I/tp, H]; `w2_weight` [E, H, I/tp] is rows
[rI/tp, (r+1)I/tp) of `down_proj` transposed; `w13_bias` the same columns of the bias;
`w2_bias` is whole on tp rank 0 and zero on the others (the down projection's partial sums
are added up across ranks, the bias once). vLLM builds the embedding, the final norm and
lm_head on every pipeline stage.

MXFP4 checkpoints (`quant_method: mxfp4`) store the two fused expert weights as
`*_blocks` and `*_scales` (plan/quant/mxfp4.py says how vLLM cuts and pads them and the
biases beside them); everything else stays in the model's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Count,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_int,
    expert_parallel_problems,
)
from shardprep.plan.archs.parts.dense import Dims, layer_params
from shardprep.plan.archs.parts.moe import group_layers
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

EMBED = "model.embed_tokens.weight"
ATTENTION = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight", "self_attn.o_proj.bias",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip
SINKS = "self_attn.sinks"
ROUTER = ("mlp.router.weight", "mlp.router.bias")
EXPERTS = "mlp.experts."
# Hub tensor under mlp.experts. -> (vLLM stack under mlp.experts.routed_experts., its cut)
STACKS: Mapping[str, tuple[str, Cut]] = {
    "gate_up_proj": ("w13_weight", Cut.EXPERT_COLS_T),
    "down_proj": ("w2_weight", Cut.EXPERT_ROWS_T),
    "gate_up_proj_bias": ("w13_bias", Cut.EXPERT_ROW),
    "down_proj_bias": ("w2_bias", Cut.EXPERT_ROW_FIRST),
}


class GptOssDims(Dims):
    """The sizes config.json implies, with GptOssConfig's defaults."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.experts = int(config["num_local_experts"])

    def layer_shapes_of(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of one decoder layer (suffixes under `model.layers.{i}.`)."""
        shapes = {
            suffix: shape
            for suffix, shape in self.layer_shapes(True, False, self.hidden).items()
            if not suffix.startswith("mlp.")
        }
        e, h, i = self.experts, self.hidden, self.intermediate
        return shapes | {
            "self_attn.o_proj.bias": (h,),
            SINKS: (self.heads,),
            "mlp.router.weight": (e, h),
            "mlp.router.bias": (e,),
            f"{EXPERTS}gate_up_proj": (e, h, 2 * i),
            f"{EXPERTS}gate_up_proj_bias": (e, 2 * i),
            f"{EXPERTS}down_proj": (e, i, h),
            f"{EXPERTS}down_proj_bias": (e, h),
        }


class GptOssFamily(Family):
    name = "gpt_oss"
    quant_schemes = frozenset({"mxfp4"})
    expert_parallel_refusal = "gpt-oss with expert parallelism is not supported yet"
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "gpt-oss is published with MXFP4 experts (quant_method mxfp4), which shardprep "
        "converts"
    }
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {
        "gpt_oss": {"num_experts": "num_local_experts"}
    }

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The experts, stacked in each layer's tensors (the bias: also in MXFP4)."""
        experts = config_int(config, "num_local_experts")
        layers = range(config_int(config, "num_hidden_layers"))
        stacks = tuple(f"model.layers.{i}.{EXPERTS}gate_up_proj_bias" for i in layers)
        return [Count("num_local_experts", experts, stacks=stacks)]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        dims = GptOssDims(config)
        layer = dims.layer_shapes_of()
        shapes = {
            f"model.layers.{i}.{suffix}": shape
            for i in range(dims.layers)
            for suffix, shape in layer.items()
        }
        shapes[EMBED] = (dims.vocab, dims.hidden)
        shapes["model.norm.weight"] = (dims.hidden,)
        shapes["lm_head.weight"] = (dims.vocab, dims.hidden)
        return shapes

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """The fused expert weights, each with its FusedMoE layer."""
        return {
            name: name.rsplit(".", 1)[0]
            for name in shapes
            if name.endswith((f"{EXPERTS}gate_up_proj", f"{EXPERTS}down_proj"))
        }

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        dims = GptOssDims(config)
        problems = dims.check_attention(tp) + dims.check_vocab(tp)
        if dims.kv_heads % tp:
            problems.append(
                f"num_key_value_heads ({dims.kv_heads}) is not divisible by tp={tp}; vLLM's "
                "gpt-oss splits the KV heads without replicating them, so choose a tp that "
                "divides them"
            )
        dp = ctx.dp
        world = tp * ctx.pp * dp
        if dims.intermediate % world:
            problems.append(
                f"intermediate_size ({dims.intermediate}) is not divisible by tp x pp x dp = "
                f"{world}, which vLLM's gpt-oss requires of the whole world size; choose "
                "sizes that divide it"
            )
        problems += expert_parallel_problems(self, ctx)
        if dims.tied:
            problems.append(
                "tie_word_embeddings is not supported for gpt-oss: vLLM loads lm_head.weight "
                "on its own"
            )
        return problems

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        dims = GptOssDims(config)
        params: list[Param] = []
        for index, names in sorted(group_layers(shapes).items()):
            stage = topology.stage_of_layer(index)
            prefix = f"model.layers.{index}."
            attention = [n for n in names if n.removeprefix(prefix) in ATTENTION]
            params += [
                dataclasses.replace(p, name=p.name.replace(".self_attn.", ".attn."))
                for p in layer_params(attention, prefix, prefix, dims, stage)
            ]
            sinks = Piece(prefix + SINKS, Cut.ROWS)
            params.append(Param(f"{prefix}attn.sinks", (sinks,), (stage,)))
            for suffix in ROUTER:
                piece = Piece(prefix + suffix, Cut.REPLICATE)
                params.append(Param(prefix + suffix, (piece,), (stage,)))
            for hub, (stack, cut) in STACKS.items():
                pieces = tuple(
                    Piece(f"{prefix}{EXPERTS}{hub}", cut, expert=e) for e in range(dims.experts)
                )
                params.append(Param(f"{prefix}{EXPERTS}routed_experts.{stack}", pieces, (stage,)))
        every = tuple(range(topology.pp))
        params += [
            Param("model.embedding.weight", (Piece(EMBED, Cut.VOCAB),), every),
            Param("model.norm.weight", (Piece("model.norm.weight", Cut.REPLICATE),), every),
            Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), every),
        ]
        return Layout(tuple(params), num_experts=dims.experts)
