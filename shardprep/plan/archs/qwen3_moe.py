"""Qwen3-MoE: Qwen3 attention (q/k norms) with FusedMoE experts, optionally mixed with
dense layers (`mlp_only_layers`, `decoder_sparse_step`).

vLLM builds the embedding, the final norm and lm_head on every pipeline stage.
"""

from __future__ import annotations

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
    config_count,
    config_int,
    expert_count,
)
from shardprep.plan.archs.parts.dense import LAYER_TENSORS, Dims, layer_params, linear_weights
from shardprep.plan.archs.parts.moe import (
    ExpertNames,
    every_stage_params,
    expert_params,
    group_layers,
    moe_problems,
    top_level_shapes,
)
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

EXPERTS = ExpertNames("gate_proj.weight", "up_proj.weight", "down_proj.weight")
DENSE_SUFFIXES = frozenset(hf for hf, _, _ in LAYER_TENSORS)
ROUTED = "mlp.experts.routed_experts."  # FusedMoE's runner holds the stacks here


class MoeDims(Dims):
    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.experts = int(config["num_experts"])
        self.moe_intermediate = int(config["moe_intermediate_size"])
        self.sparse_step = int(config.get("decoder_sparse_step") or 1)
        self.mlp_only = {int(i) for i in config.get("mlp_only_layers") or ()}
        self.qkv_bias = bool(config.get("attention_bias", False))

    def is_sparse(self, layer: int) -> bool:
        """vLLM's `Qwen3MoeDecoderLayer` rule."""
        return (
            layer not in self.mlp_only and self.experts > 0 and (layer + 1) % self.sparse_step == 0
        )

    @property
    def has_dense(self) -> bool:
        return any(not self.is_sparse(i) for i in range(self.layers))


class Qwen3MoeFamily(Family):
    name = "qwen3_moe"
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {
        "qwen3_moe": {"num_experts": "num_local_experts"}
    }
    quant_schemes = frozenset({"fp8_block", "fp8_tensor", "fp8_ct", "nvfp4_pack", "modelopt_fp4"})
    kv_cache_scales = True

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """Attention, dense MLPs, experts, and the router: vLLM builds `mlp.gate` with the
        model's quantization (published fp8 checkpoints list it in modules_to_not_convert)."""
        routers = {n: n.removesuffix(".weight") for n in shapes if n.endswith(".mlp.gate.weight")}
        return linear_weights(shapes) | EXPERTS.weights(shapes) | routers

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        config_int(config, "decoder_sparse_step", 1)  # vLLM divides by it
        config_count(config, "num_experts")
        dims = MoeDims(config)
        return [expert_count(config, "num_experts", sum(map(dims.is_sparse, range(dims.layers))))]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        dims = MoeDims(config)
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(dims.layers):
            layer = dims.layer_shapes(dims.qkv_bias, True, dims.hidden)
            prefix = f"model.layers.{i}."
            if dims.is_sparse(i):
                for suffix in (
                    "mlp.gate_proj.weight",
                    "mlp.up_proj.weight",
                    "mlp.down_proj.weight",
                ):
                    del layer[suffix]
                layer["mlp.gate.weight"] = (dims.experts, dims.hidden)
                experts = EXPERTS.shapes(
                    "mlp.experts.", dims.experts, dims.moe_intermediate, dims.hidden
                )
                layer |= experts
            shapes |= {prefix + suffix: shape for suffix, shape in layer.items()}
        return shapes | top_level_shapes(dims.vocab, dims.hidden, dims.tied)

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        dims = MoeDims(config)
        problems = dims.check_attention(tp) + dims.check_vocab(tp)
        if dims.has_dense:
            problems += dims.check_intermediate(tp)
        if int(config.get("shared_expert_intermediate_size") or 0):
            problems.append("Qwen3-MoE with shared experts is not supported yet")
        return problems + moe_problems(
            num_experts=dims.experts,
            moe_intermediate=dims.moe_intermediate,
            tp=tp,
            dp=ctx.dp,
            expert_parallel=ctx.expert_parallel,
        )

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        dims = MoeDims(config)
        params: list[Param] = []
        for index, names in sorted(group_layers(shapes).items()):
            stage = topology.stage_of_layer(index)
            prefix = f"model.layers.{index}."
            plain = [n for n in names if n.removeprefix(prefix) in DENSE_SUFFIXES]
            params += layer_params(plain, prefix, prefix, dims, stage)
            if dims.is_sparse(index):
                gate = f"{prefix}mlp.gate.weight"
                params.append(Param(gate, (Piece(gate, Cut.REPLICATE),), (stage,)))
                params += expert_params(
                    EXPERTS, f"{prefix}mlp.experts.", f"{prefix}{ROUTED}", dims.experts, stage
                )
        top, skipped = every_stage_params(dims.tied, shapes, topology.pp)
        return Layout(tuple(params + top), skipped, num_experts=dims.experts)
