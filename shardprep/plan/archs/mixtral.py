"""Mixtral: Llama attention with a FusedMoE block in every layer (`block_sparse_moe`,
experts named w1 = gate, w3 = up, w2 = down).

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

EXPERTS = ExpertNames("w1.weight", "w3.weight", "w2.weight")
ATTENTION_SUFFIXES = frozenset(hf for hf, _, _ in LAYER_TENSORS if not hf.startswith("mlp."))
MOE = "block_sparse_moe."


class MixtralFamily(Family):
    name = "mixtral"
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {
        "mixtral": {"num_experts": "num_local_experts"}
    }
    quant_schemes = frozenset({"fp8_block", "fp8_tensor", "fp8_ct"})
    kv_cache_scales = True

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """Attention and experts; vLLM builds the router without the quantization."""
        return linear_weights(shapes) | EXPERTS.weights(shapes)

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        layers = Dims(config).layers
        return [expert_count(config, "num_local_experts", layers, required=True)]

    @staticmethod
    def _experts(config: Config) -> int:
        return int(config["num_local_experts"])

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        dims = Dims(config)
        experts = self._experts(config)
        layer = {
            suffix: shape
            for suffix, shape in dims.layer_shapes(False, False, dims.hidden).items()
            if not suffix.startswith("mlp.")
        }
        layer[f"{MOE}gate.weight"] = (experts, dims.hidden)
        layer |= EXPERTS.shapes(f"{MOE}experts.", experts, dims.intermediate, dims.hidden)
        shapes = {
            f"model.layers.{i}.{suffix}": shape
            for i in range(dims.layers)
            for suffix, shape in layer.items()
        }
        return shapes | top_level_shapes(dims.vocab, dims.hidden, dims.tied)

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        dims = Dims(config)
        return (
            dims.check_attention(tp)
            + dims.check_vocab(tp)
            + moe_problems(
                num_experts=self._experts(config),
                moe_intermediate=dims.intermediate,
                tp=tp,
                dp=ctx.dp,
                expert_parallel=ctx.expert_parallel,
            )
        )

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        dims = Dims(config)
        experts = self._experts(config)
        params: list[Param] = []
        for index, names in sorted(group_layers(shapes).items()):
            stage = topology.stage_of_layer(index)
            prefix = f"model.layers.{index}."
            attention = [n for n in names if n.removeprefix(prefix) in ATTENTION_SUFFIXES]
            params += layer_params(attention, prefix, prefix, dims, stage)
            gate = f"{prefix}{MOE}gate.weight"
            params.append(Param(gate, (Piece(gate, Cut.REPLICATE),), (stage,)))
            moe = f"{prefix}{MOE}experts."
            params += expert_params(EXPERTS, moe, f"{moe}routed_experts.", experts, stage)
        top, skipped = every_stage_params(dims.tied, shapes, topology.pp)
        return Layout(tuple(params + top), skipped, num_experts=experts)
