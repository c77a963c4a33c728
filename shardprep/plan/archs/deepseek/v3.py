"""DeepSeek-V2 and DeepSeek-V3 (Kimi-K2 is a V3): MLA attention, dense first layers, shared
and routed experts, optionally fp8 block-quantized.

vLLM (`deepseek_v2.py`) fuses `q_a_proj` and `kv_a_proj_with_mqa` into a replicated
`fused_qkv_a_proj` when `q_lora_rank` is set, splits `q_b_proj`/`q_proj`/`kv_b_proj` by
whole heads and `o_proj` by columns, splits shared experts like a dense MLP, keeps the
router and its `e_score_correction_bias` (float32) whole, puts the embedding on the
first stage only and the final norm and lm_head on the last. MTP layers (index >=
num_hidden_layers) belong to a draft; the target skips them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    BuiltinDraft,
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
from shardprep.plan.archs.parts.mla import (
    Dims,
    fused_params,
    layer_quantized,
    layer_sources,
    layer_tensors,
    split_problems,
)
from shardprep.plan.archs.parts.mtp import MTP_LAYERS
from shardprep.plan.archs.parts.names import LAYER
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.experts import w2_pieces, w13_pieces
from shardprep.plan.topology import Topology


class DeepseekFamily(Family):
    name = "deepseek"
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {
        "deepseek_v2": {"num_experts": "n_routed_experts"},
        "deepseek_v3": {
            "num_local_experts": "n_routed_experts",
            "num_mtp_layers": "num_nextn_predict_layers",
        },
    }
    quant_schemes = frozenset({"fp8_block", "fp8_ct", "int4_pack", "mxfp4_pack", "nvfp4_pack"})
    builtin_draft: ClassVar[BuiltinDraft | None] = MTP_LAYERS
    experts_only_schemes = frozenset({"nvfp4_pack"})  # NVFP4 MLA layers: not proven yet

    def dims(self, config: Config) -> Dims:
        """The sizes config.json implies."""
        return Dims.of(config)

    def layer_sources(self, d: Dims, layer: int) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """{Hugging Face name: (shape, fixed dtype)} of one decoder layer's tensors."""
        return layer_sources(d, layer)

    def layer_quantized(self, d: Dims, layer: int) -> dict[str, str]:
        """{source weight: vLLM layer} of one decoder layer's quantized weights."""
        return layer_quantized(d, layer)

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        config_int(config, "moe_layer_freq", 1)  # vLLM divides by it
        for key in ("first_k_dense_replace", "n_shared_experts", "n_routed_experts"):
            config_count(config, key)
        mtp = config_count(config, "num_nextn_predict_layers")
        d = self.dims(config)
        experts = expert_count(config, "n_routed_experts", d.moe_layers(range(d.layers)))
        return [experts, Count("num_nextn_predict_layers", mtp, mtp)]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._sources(config).items()}

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        """The MTP layers (index >= num_hidden_layers)."""
        layers = self.dims(config).layers
        return [n for n in shapes if (match := LAYER.match(n)) and int(match[1]) >= layers]

    def internal_draft(self, config: Config) -> str | None:
        """The draft method of the MTP layers the checkpoint carries, if vLLM serves
        them as a draft: only DeepSeek-V3 configs become MTP drafts (`speculative.py`)."""
        layers = config.get("num_nextn_predict_layers") or 0
        return "mtp" if config.get("model_type") == "deepseek_v3" and layers else None

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """Tensors whose checkpoint dtype is not the model's: the routing bias."""
        return {name: dtype for name, (_, dtype) in self._sources(config).items() if dtype}

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        d = self.dims(config)
        found: dict[str, str] = {}
        for layer in range(d.layers):
            found |= self.layer_quantized(d, layer)
        return found

    def _sources(self, config: Config) -> dict[str, tuple[tuple[int, ...], str | None]]:
        d = self.dims(config)
        found: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for layer in range(d.layers):
            found |= self.layer_sources(d, layer)
        found["model.embed_tokens.weight"] = ((d.vocab, d.hidden), None)
        found["model.norm.weight"] = ((d.hidden,), None)
        found["lm_head.weight"] = ((d.vocab, d.hidden), None)
        return found

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        try:
            d = self.dims(config)
        except (KeyError, ValueError, TypeError):
            return []  # expected_shapes reports what config.json lacks
        problems = []
        if d.tied:
            problems.append("tie_word_embeddings is not supported for DeepSeek models")
        if d.shared and ctx.expert_parallel and tp > 1 and ctx.dp > 1:
            # vLLM's sequence-parallel MoE (`use_sequence_parallel_moe`) then replicates them.
            problems.append(
                "with --enable-expert-parallel, tp > 1 and dp > 1 vLLM replicates the shared "
                "experts, a layout shardprep does not write yet; use --tp 1 or --dp 1"
            )
        return problems + split_problems(d, tp)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d = self.dims(config)
        last = topology.last_stage
        params: list[Param] = []
        for layer in range(d.layers):
            stage = topology.stage_of_layer(layer)
            prefix = f"model.layers.{layer}."
            params += fused_params(self.layer_params(d, layer, prefix), stage)
        vocab = Piece("model.embed_tokens.weight", Cut.VOCAB)
        params.append(Param("model.embed_tokens.weight", (vocab,), (0,)))
        norm = Piece("model.norm.weight", Cut.REPLICATE)
        params.append(Param("model.norm.weight", (norm,), (last,)))
        params.append(Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), (last,)))
        return Layout(tuple(params), num_experts=d.experts, num_expert_group=d.groups)

    def layer_params(
        self, d: Dims, layer: int, prefix: str
    ) -> Iterator[tuple[str, Piece, str | None]]:
        """(vLLM name, piece, fixed dtype) in stacking order; pieces of one name fuse."""
        for t in layer_tensors(d, layer):
            yield prefix + t.vllm, Piece(prefix + t.hf, t.cut), t.dtype
        if d.is_moe(layer):
            experts, routed = f"{prefix}mlp.experts.", f"{prefix}mlp.experts.routed_experts."
            gate_up = [
                (f"{experts}{e}.gate_proj.weight", f"{experts}{e}.up_proj.weight")
                for e in range(d.experts)
            ]
            down = [f"{experts}{e}.down_proj.weight" for e in range(d.experts)]
            for piece in w13_pieces(gate_up):
                yield routed + "w13_weight", piece, None
            for piece in w2_pieces(down):
                yield routed + "w2_weight", piece, None
