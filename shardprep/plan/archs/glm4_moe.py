"""GLM-4.5, GLM-4.6 and GLM-4.7 (`Glm4MoeForCausalLM`) and their MTP draft (vLLM's
`glm4_moe.py` and `glm4_moe_mtp.py`).

Attention is Llama's (`qkv_proj` with bias when `attention_bias`, replicated `q_norm` and
`k_norm` when `use_qk_norm`; partial rotary has no weights). The first
`first_k_dense_replace` layers are dense MLPs; the others hold a router that vLLM builds
in float32 whatever the checkpoint's dtype (`GateLinear(params_dtype=float32)`), its
float32 `e_score_correction_bias`, shared experts split like a dense MLP and the routed
experts in FusedMoE's stacks. The embedding is on the first stage only, the final norm
and lm_head on the last.

The MTP layers are `model.layers.{L+i}` of the target checkpoint (L = num_hidden_layers):
a decoder layer (under `mtp_block.` in vLLM) plus `enorm`, `hnorm`, `eh_proj` and
`shared_head.norm`. The checkpoint holds no vocab head or embedding of its own there:
`Glm4MoeMTP.load_weights` loads `shared_head.head` from `lm_head.weight` and the
embedding from `model.embed_tokens.weight`. vLLM's proposer then replaces every
`shared_head.head` with the target's lm_head, and at pp = 1 the embedding with the
target's: those are not written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Count,
    DraftFamily,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_count,
    expert_count,
)
from shardprep.plan.archs.parts.dense import Dims, layer_params, linear_weights
from shardprep.plan.archs.parts.moe import ExpertNames, expert_params, moe_problems
from shardprep.plan.archs.parts.mtp import (
    BLOCK,
    HEAD,
    MTP_LAYERS,
    OWN,
    mtp_layers,
    require_mtp_layer,
)
from shardprep.plan.archs.parts.names import LAYER
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

EXPERTS = ExpertNames("gate_proj.weight", "up_proj.weight", "down_proj.weight")
ROUTER = "mlp.gate.weight"
BIAS = "mlp.gate.e_score_correction_bias"
SHARED = "mlp.shared_experts."
F32 = "F32"
EMBED = "model.embed_tokens.weight"
ATTRIBUTE_MAPS: Mapping[str, Mapping[str, str]] = {
    "glm4_moe": {
        "num_local_experts": "n_routed_experts",
        "num_mtp_layers": "num_nextn_predict_layers",
    }
}


class GlmDims(Dims):
    """The sizes config.json implies, with Glm4MoeConfig's defaults."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        experts = config.get("n_routed_experts")
        self.experts = int(experts) if experts else 0
        self.moe_intermediate = int(config.get("moe_intermediate_size") or 0)
        self.shared = int(config.get("n_shared_experts") or 0)
        self.first_dense = int(config.get("first_k_dense_replace") or 0)
        self.qkv_bias = bool(config.get("attention_bias", False))
        self.qk_norm = bool(config.get("use_qk_norm", False))
        self.mtp = int(config.get("num_nextn_predict_layers") or 0)
        self.groups = int(config.get("n_group") or 1)

    def counts(self, config: Config) -> list[Count]:
        """The routed experts of the decoder layers (three tensors each), and the MTP
        layers, each with its own norms and projection, and its experts."""
        mtp = range(self.layers, self.layers + self.mtp)
        return [
            expert_count(config, "n_routed_experts", self.moe_layers(range(self.layers))),
            Count(
                "num_nextn_predict_layers",
                self.mtp,
                self.mtp * len(OWN) + 3 * self.experts * self.moe_layers(mtp),
            ),
        ]

    def moe_layers(self, layers: range) -> int:
        """How many of `layers` hold experts."""
        return max(0, layers.stop - max(layers.start, self.first_dense)) if self.experts else 0

    def is_moe(self, layer: int) -> bool:
        """vLLM's `Glm4MoeDecoderLayer` rule."""
        return bool(self.experts) and layer >= self.first_dense

    def layer_shapes_of(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Every tensor of one decoder layer (suffixes under `model.layers.{layer}.`)."""
        shapes = self.layer_shapes(self.qkv_bias, self.qk_norm, self.hidden)
        if not self.is_moe(layer):
            return shapes
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"mlp.{proj}.weight"]
        shapes[ROUTER] = (self.experts, self.hidden)
        shapes[BIAS] = (self.experts,)
        if self.shared:
            size = self.moe_intermediate * self.shared
            shapes |= {
                f"{SHARED}gate_proj.weight": (size, self.hidden),
                f"{SHARED}up_proj.weight": (size, self.hidden),
                f"{SHARED}down_proj.weight": (self.hidden, size),
            }
        return shapes | EXPERTS.shapes(
            "mlp.experts.", self.experts, self.moe_intermediate, self.hidden
        )

    def layer_params_of(
        self, layer: int, hf_prefix: str, vllm_prefix: str, stage: int
    ) -> list[Param]:
        """vLLM's parameters of decoder layer `layer`, read from `hf_prefix` and named
        under `vllm_prefix` (the MTP draft's `mtp_block.`)."""
        names = [hf_prefix + suffix for suffix in self.layer_shapes_of(layer)]
        plain = [n for n in names if _is_plain(n.removeprefix(hf_prefix))]
        params = layer_params(plain, hf_prefix, vllm_prefix, self, stage)
        if not self.is_moe(layer):
            return params
        for suffix in (ROUTER, BIAS):  # both float32 in vLLM
            piece = Piece(hf_prefix + suffix, Cut.REPLICATE)
            params.append(Param(vllm_prefix + suffix, (piece,), (stage,), F32))
        if self.shared:
            gate_up = tuple(
                Piece(f"{hf_prefix}{SHARED}{proj}.weight", Cut.ROWS)
                for proj in ("gate_proj", "up_proj")
            )
            down = Piece(f"{hf_prefix}{SHARED}down_proj.weight", Cut.COLS)
            params.append(Param(f"{vllm_prefix}{SHARED}gate_up_proj.weight", gate_up, (stage,)))
            params.append(Param(f"{vllm_prefix}{SHARED}down_proj.weight", (down,), (stage,)))
        params += expert_params(
            EXPERTS,
            f"{hf_prefix}mlp.experts.",
            f"{vllm_prefix}mlp.experts.routed_experts.",
            self.experts,
            stage,
        )
        return params

    def problems(self, tp: int, ctx: PlanContext) -> list[str]:
        problems = self.check_attention(tp) + self.check_vocab(tp)
        if self.tied:
            problems.append("tie_word_embeddings is not supported for GLM-4.5 models")
        if self.first_dense or not self.experts:
            problems += self.check_intermediate(tp)
        if not self.experts:
            return problems
        if self.shared and (self.moe_intermediate * self.shared) % tp:
            problems.append(
                f"moe_intermediate_size x n_shared_experts ({self.moe_intermediate * self.shared}) "
                f"is not divisible by tp={tp}; choose a tp that divides it"
            )
        return problems + moe_problems(
            num_experts=self.experts,
            moe_intermediate=self.moe_intermediate,
            tp=tp,
            dp=ctx.dp,
            expert_parallel=ctx.expert_parallel,
        )


def quantized_weights(names: Iterable[str], layers: Iterable[int]) -> dict[str, str]:
    """{source weight: vLLM layer} of the layers vLLM builds with the model's quantization
    in decoder layers `layers` (an MTP layer's decoder block keeps its checkpoint prefix):
    attention, dense and shared-expert MLPs, routed experts. The router (`GateLinear`,
    float32) and the MTP layer's `eh_proj` (`nn.Linear`) never take it."""
    wanted = {f"model.layers.{i}." for i in layers}
    names = [n for n in names if (m := LAYER.match(n)) and f"model.layers.{m[1]}." in wanted]
    shared = {
        name: name.rsplit(".", 2)[0] + (".down_proj" if ".down_proj." in name else ".gate_up_proj")
        for name in names
        if SHARED in name and name.endswith("_proj.weight")
    }
    return linear_weights(names) | EXPERTS.weights(names) | shared


def _is_plain(suffix: str) -> bool:
    """A tensor that Llama's rules place: attention, norms and the dense MLP."""
    return not suffix.startswith(("mlp.gate.", SHARED, "mlp.experts."))


COUNTED = (
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
)


def glm_dims(config: Config) -> GlmDims:
    """GlmDims once the counts it reads are whole numbers."""
    for key in COUNTED:
        config_count(config, key)
    return GlmDims(config)


class Glm4MoeFamily(Family):
    name = "glm4_moe"
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = ATTRIBUTE_MAPS
    quant_schemes = frozenset({"fp8_block"})
    builtin_draft = MTP_LAYERS
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "GLM-4.5 is published with fp8 blocks (quant_method fp8, weight_block_size), "
        "which shardprep converts"
    }
    kv_cache_scales = True

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        return glm_dims(config).counts(config)

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        return quantized_weights(shapes, range(GlmDims(config).layers))

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        d = GlmDims(config)
        shapes = {
            f"model.layers.{i}.{suffix}": shape
            for i in range(d.layers)
            for suffix, shape in d.layer_shapes_of(i).items()
        }
        shapes[EMBED] = (d.vocab, d.hidden)
        shapes["model.norm.weight"] = (d.hidden,)
        shapes["lm_head.weight"] = (d.vocab, d.hidden)
        return shapes

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """The routing bias, float32 in the published checkpoints."""
        d = GlmDims(config)
        layers = [*range(d.layers), *mtp_layers(config)]
        return {f"model.layers.{i}.{BIAS}": F32 for i in layers if d.is_moe(i)}

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        """The MTP layers (index >= num_hidden_layers)."""
        layers = GlmDims(config).layers
        return [n for n in shapes if (match := LAYER.match(n)) and int(match[1]) >= layers]

    def internal_draft(self, config: Config) -> str | None:
        """vLLM serves the MTP layers as the `mtp` draft (`speculative.py`)."""
        return "mtp" if glm_dims(config).mtp else None

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        return GlmDims(config).problems(tp, ctx)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d = GlmDims(config)
        params: list[Param] = []
        for layer in range(d.layers):
            prefix = f"model.layers.{layer}."
            params += d.layer_params_of(layer, prefix, prefix, topology.stage_of_layer(layer))
        last = topology.last_stage
        params.append(Param(EMBED, (Piece(EMBED, Cut.VOCAB),), (0,)))
        norm = Piece("model.norm.weight", Cut.REPLICATE)
        params.append(Param("model.norm.weight", (norm,), (last,)))
        params.append(Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), (last,)))
        return Layout(tuple(params), num_experts=d.experts, num_expert_group=d.groups)


class Glm4MoeMtpDraft(DraftFamily):
    name = "glm4_moe_mtp"
    standalone = False  # it comes inside its target, never with --draft
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = ATTRIBUTE_MAPS
    # `Glm4MoeMTP.load_weights` maps no KV-cache scale: a checkpoint whose MTP layer ships
    # them cannot be loaded by vLLM, and its tensors are refused as unknown.
    quant_schemes = Glm4MoeFamily.quant_schemes
    quant_refusals = Glm4MoeFamily.quant_refusals

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        return glm_dims(config).counts(config)

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        return quantized_weights(shapes, mtp_layers(config))

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        d, names = GlmDims(config), ctx.draft_names
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in mtp_layers(config):
            prefix = f"model.layers.{layer}."
            require_mtp_layer(names, prefix, layer, config)
            shapes |= {prefix + s: shape for s, shape in d.layer_shapes_of(layer).items()}
            shapes |= {prefix + name: (d.hidden,) for name in OWN}
            shapes[prefix + "eh_proj.weight"] = (d.hidden, 2 * d.hidden)
        return shapes

    def source_dtypes(self, config: Config) -> dict[str, str]:
        return Glm4MoeFamily().source_dtypes(config)

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        """The MTP layers have the target's sizes: the target's checks cover them."""
        return []

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d, last = GlmDims(config), topology.last_stage
        params: list[Param] = []
        shared: set[str] = set()
        for layer in mtp_layers(config):
            prefix = f"model.layers.{layer}."
            params += d.layer_params_of(layer, prefix, prefix + BLOCK, last)
            for name in OWN:
                params.append(Param(prefix + name, (Piece(prefix + name, Cut.REPLICATE),), (last,)))
            shared.add(prefix + HEAD)  # loaded from lm_head.weight, then the target's
        if topology.pp > 1:  # the draft, on the last stage, keeps its own embedding
            params.append(Param(EMBED, (Piece(EMBED, Cut.VOCAB),), (last,)))
        else:
            shared.add(EMBED)
        used = {piece.source for param in params for piece in param.pieces}
        skipped = {name: "a tensor of the target" for name in shapes if name not in used}
        return Layout(
            tuple(params),
            skipped,
            shared_with_target=frozenset(shared),
            num_experts=d.experts,
            num_expert_group=d.groups,
        )
