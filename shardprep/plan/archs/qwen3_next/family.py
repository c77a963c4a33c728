"""Qwen3-Next (`Qwen3NextForCausalLM`) and its MTP draft (vLLM's `qwen3_next.py`,
`qwen3_next_mtp.py` and the gated DeltaNet of `mamba/gdn/qwen_gdn_linear_attn.py`).

Each decoder layer is either a gated DeltaNet (`linear_attn.`) or gated full attention
(`self_attn.`), as `layer_types` says (transformers' default: every
`full_attention_interval`-th layer full, the others linear), and holds either experts or
a dense MLP (Qwen3-MoE's rule: `mlp_only_layers`, `decoder_sparse_step`).

- DeltaNet: `in_proj_qkvz` and `in_proj_ba` are stored grouped per key head, and vLLM
  builds each as one column-parallel output, so a rank holds a contiguous 1/tp of the
  rows (whole key-head groups); `conv1d.weight` [2K + V, 1, kernel] holds q, k and v
  rows, and a rank takes its share of each (`Cut.QKV_ROWS`); `A_log` is float32 in vLLM
  whatever the checkpoint's dtype, `A_log` and `dt_bias` split by value heads;
  `out_proj` row-parallel; the gated norm replicated.
- Full attention: Llama's `qkv_proj` whose q part also carries the output gate (q_proj
  has 2 x heads x head_dim rows, each head's q then its gate), q/k norms; no bias (vLLM
  builds none, whatever `attention_bias` says).
- Experts: a replicated router, FusedMoE's stacks, one shared expert split like a dense
  MLP, and `shared_expert_gate` [1, H] replicated.

vLLM builds the embedding and lm_head on every pipeline stage, the final norm on the last.

The MTP draft is stored as `mtp.*` in the target checkpoint: `mtp.fc` (column-parallel),
`mtp.layers.{i}` (full-attention decoder layers, local index i), `mtp.norm` and
`mtp.pre_fc_norm_{hidden,embedding}`; vLLM names them `model.*`. It loads its embedding
and lm_head from the target's tensors; its proposer then replaces lm_head with the
target's at any pp and the embedding at pp = 1: those are not written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import ClassVar

from shardprep.errors import ConfigError
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
)
from shardprep.plan.archs.parts.dense import LAYER_TENSORS, LINEAR_SUFFIXES, Dims, layer_params
from shardprep.plan.archs.parts.moe import ExpertNames, expert_params, moe_problems
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

EXPERTS = ExpertNames("gate_proj.weight", "up_proj.weight", "down_proj.weight")
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
NORM = "model.norm.weight"
F32 = "F32"
LINEAR = "linear_attention"
FULL = "full_attention"
SHARED = "mlp.shared_expert."
ROUTED = "mlp.experts.routed_experts."
LLAMA_RULES = frozenset(hf for hf, _, _ in LAYER_TENSORS)  # attention, dense MLP, norms
MTP_OWN = ("norm.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")
# The linear layers of a decoder layer that vLLM builds with the model's quantization,
# by the checkpoint's suffix, and their vLLM layer; `conv1d`, the router (`GateLinear`) and
# `shared_expert_gate` are built without it.
QUANTIZED = {
    **{hf: vllm.removesuffix(".weight") for hf, vllm, _ in LAYER_TENSORS if hf in LINEAR_SUFFIXES},
    "linear_attn.in_proj_qkvz.weight": "linear_attn.in_proj_qkvz",
    "linear_attn.in_proj_ba.weight": "linear_attn.in_proj_ba",
    "linear_attn.out_proj.weight": "linear_attn.out_proj",
    f"{SHARED}gate_proj.weight": f"{SHARED}gate_up_proj",
    f"{SHARED}up_proj.weight": f"{SHARED}gate_up_proj",
    f"{SHARED}down_proj.weight": f"{SHARED}down_proj",
}
ANY_LAYER = re.compile(r"^((?:model|mtp)\.layers\.\d+\.)(.+)$")
ANY_EXPERT = re.compile(
    r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.\d+\.(?:gate|up|down)_proj\.weight$"
)


class NextDims(Dims):
    """The sizes config.json implies, with Qwen3NextConfig's defaults."""

    label = "Qwen3-Next"  # the family's name in messages
    mtp_key = "num_nextn_predict_layers"  # where config.json counts the MTP layers

    @classmethod
    def counted(cls, config: Config) -> NextDims:
        """The sizes, once the counts config.json holds are whole numbers."""
        config_int(config, "decoder_sparse_step", 1)  # vLLM divides by it
        config_count(config, "num_experts")
        config_count(config, cls.mtp_key)
        return cls(config)

    def moe_count(self, layers: int) -> int:
        """How many of the first `layers` layers hold experts, without enumerating them."""
        if not self.experts:
            return 0
        dense = sum(1 for i in self.mlp_only if i < layers and (i + 1) % self.sparse_step == 0)
        return layers // self.sparse_step - dense

    def expert_count(self) -> Count:
        """The routed experts of the decoder layers, three tensors each."""
        return Count("num_experts", self.experts, 3 * self.experts * self.moe_count(self.layers))

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.experts = int(config.get("num_experts") or 0)
        self.moe_intermediate = int(config.get("moe_intermediate_size") or 0)
        self.shared = int(config.get("shared_expert_intermediate_size") or 0)
        self.sparse_step = int(config.get("decoder_sparse_step") or 1)
        self.mlp_only = {int(i) for i in config.get("mlp_only_layers") or ()}
        self.gate = bool(config.get("attn_output_gate", True))
        self.k_heads = int(config.get("linear_num_key_heads") or 16)
        self.v_heads = int(config.get("linear_num_value_heads") or 32)
        self.k_dim = int(config.get("linear_key_head_dim") or 128)
        self.v_dim = int(config.get("linear_value_head_dim") or 128)
        self.kernel = int(config.get("linear_conv_kernel_dim") or 4)
        self.mtp = int(config.get("num_nextn_predict_layers", 1) or 0)
        self.layer_types = _layer_types(config, self.layers)

    def is_moe(self, layer: int) -> bool:
        """vLLM's `Qwen3NextDecoderLayer` rule (an MTP layer by its local index)."""
        return (
            layer not in self.mlp_only and self.experts > 0 and (layer + 1) % self.sparse_step == 0
        )

    def layer_shapes_of(self, layer: int, kind: str) -> dict[str, tuple[int, ...]]:
        """Every tensor of one decoder layer of `kind` (suffixes under its prefix)."""
        shapes = self.layer_shapes(False, True, self.hidden)
        if kind == FULL:
            if self.gate:
                q = shapes["self_attn.q_proj.weight"]
                shapes["self_attn.q_proj.weight"] = (2 * q[0], q[1])
        else:
            shapes = {k: v for k, v in shapes.items() if not k.startswith("self_attn.")}
            key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
            shapes |= self.projection_shapes()
            shapes |= {
                "linear_attn.conv1d.weight": (2 * key + value, 1, self.kernel),
                "linear_attn.dt_bias": (self.v_heads,),
                "linear_attn.A_log": (self.v_heads,),
                "linear_attn.norm.weight": (self.v_dim,),
                "linear_attn.out_proj.weight": (self.hidden, value),
            }
        if not self.is_moe(layer):
            return shapes
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del shapes[f"mlp.{proj}.weight"]
        shapes["mlp.gate.weight"] = (self.experts, self.hidden)
        if self.shared:
            shapes |= {
                f"{SHARED}gate_proj.weight": (self.shared, self.hidden),
                f"{SHARED}up_proj.weight": (self.shared, self.hidden),
                f"{SHARED}down_proj.weight": (self.hidden, self.shared),
                "mlp.shared_expert_gate.weight": (1, self.hidden),
            }
        return shapes | self.expert_shapes()

    def projection_shapes(self) -> dict[str, tuple[int, ...]]:
        """A DeltaNet's input projections in the checkpoint: Qwen3-Next's two fused ones,
        each grouped per key head."""
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        return {
            "linear_attn.in_proj_qkvz.weight": (2 * key + 2 * value, self.hidden),
            "linear_attn.in_proj_ba.weight": (2 * self.v_heads, self.hidden),
        }

    def projection_params(self, hf_prefix: str, vllm_prefix: str, stage: int) -> list[Param]:
        """vLLM's `in_proj_qkvz` and `in_proj_ba`: one column-parallel output each
        (`gqa_interleaved_layout`), so a rank holds a contiguous 1/tp of the rows."""
        return [
            Param(vllm_prefix + s, (Piece(hf_prefix + s, Cut.ROWS),), (stage,))
            for s in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")
        ]

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """The routed experts of one layer, one tensor per expert and projection."""
        return EXPERTS.shapes("mlp.experts.", self.experts, self.moe_intermediate, self.hidden)

    def expert_stack_params(self, hf_prefix: str, vllm_prefix: str, stage: int) -> list[Param]:
        return expert_params(
            EXPERTS, f"{hf_prefix}mlp.experts.", vllm_prefix + ROUTED, self.experts, stage
        )

    def layer_params_of(
        self, layer: int, kind: str, hf_prefix: str, vllm_prefix: str, stage: int
    ) -> list[Param]:
        """vLLM's parameters of one decoder layer, read from `hf_prefix`, named under
        `vllm_prefix`."""
        plain = [hf_prefix + s for s in self.layer_shapes_of(layer, kind) if s in LLAMA_RULES]
        params = layer_params(plain, hf_prefix, vllm_prefix, self, stage)

        def add(suffix: str, cut: Cut, dtype: str | None = None, heads: int = 0) -> None:
            piece = Piece(hf_prefix + suffix, cut, heads)
            params.append(Param(vllm_prefix + suffix, (piece,), (stage,), dtype))

        if kind == LINEAR:
            params += self.projection_params(hf_prefix, vllm_prefix, stage)
            add("linear_attn.conv1d.weight", Cut.QKV_ROWS, heads=self.k_heads * self.k_dim)
            add("linear_attn.dt_bias", Cut.ROWS)
            add("linear_attn.A_log", Cut.ROWS, F32)
            add("linear_attn.norm.weight", Cut.REPLICATE)
            add("linear_attn.out_proj.weight", Cut.COLS)
        if not self.is_moe(layer):
            return params
        add("mlp.gate.weight", Cut.REPLICATE)
        if self.shared:
            gate_up = tuple(
                Piece(f"{hf_prefix}{SHARED}{proj}.weight", Cut.ROWS)
                for proj in ("gate_proj", "up_proj")
            )
            down = Piece(f"{hf_prefix}{SHARED}down_proj.weight", Cut.COLS)
            params.append(Param(f"{vllm_prefix}{SHARED}gate_up_proj.weight", gate_up, (stage,)))
            params.append(Param(f"{vllm_prefix}{SHARED}down_proj.weight", (down,), (stage,)))
            add("mlp.shared_expert_gate.weight", Cut.REPLICATE)
        return params + self.expert_stack_params(hf_prefix, vllm_prefix, stage)

    def problems(self, tp: int, ctx: PlanContext, attention_bias: bool = False) -> list[str]:
        problems = self.check_attention(tp) + self.check_vocab(tp)
        if self.tied:
            problems.append(f"tie_word_embeddings is not supported for {self.label} models")
        if attention_bias:
            problems.append(
                f"attention_bias is true, but vLLM builds {self.label}'s attention without "
                "biases; this checkpoint cannot be served by vLLM"
            )
        linear_heads = {
            "linear_num_key_heads": self.k_heads,
            "linear_num_value_heads": self.v_heads,
        }
        for key, heads in linear_heads.items():
            if heads % tp:
                problems.append(
                    f"{key} ({heads}) is not divisible by tp={tp}; choose a tp that divides it"
                )
        if self.v_heads % self.k_heads:
            problems.append(
                f"linear_num_value_heads ({self.v_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.k_heads}); fix config.json"
            )
        wrong = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if wrong:
            problems.append(
                f"layer_types holds {', '.join(wrong)}; {self.label} layers are {LINEAR} or {FULL}"
            )
        if any(not self.is_moe(i) for i in range(self.layers)):
            problems += self.check_intermediate(tp)
        if not self.experts:
            return problems
        if self.shared % tp:
            problems.append(
                f"shared_expert_intermediate_size ({self.shared}) is not divisible by tp={tp}; "
                "choose a tp that divides it"
            )
        return problems + moe_problems(
            num_experts=self.experts,
            moe_intermediate=self.moe_intermediate,
            tp=tp,
            dp=ctx.dp,
            expert_parallel=ctx.expert_parallel,
        )


def quantized_weights(names: Iterable[str], prefix: str) -> dict[str, str]:
    """{source weight: vLLM layer} of the quantized weights of the decoder layers under
    `prefix` (`model.layers.`, or the MTP draft's `mtp.layers.`, which vLLM's layers keep
    as their names), routed experts included."""
    found = {}
    for name in names:
        if not name.startswith(prefix):
            continue
        if match := ANY_EXPERT.match(name):
            found[name] = match[1]
        elif (match := ANY_LAYER.match(name)) and match[2] in QUANTIZED:
            found[name] = match[1] + QUANTIZED[match[2]]
    return found


def _layer_types(config: Config, layers: int) -> list[str]:
    """`layer_types`, or transformers' default from `full_attention_interval`."""
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval") or 4)
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(
            f"config.json's layer_types does not name one type for each of the {layers} "
            "layers; fix config.json"
        )
    return [str(t) for t in types]


class Qwen3NextFamily(Family):
    builtin_draft = BuiltinDraft(
        "mtp",
        held="a tensor of the MTP draft",
        left_out="a tensor of the MTP draft; vLLM loads it only as the MTP draft, which "
        "--no-mtp or another --draft leaves out",
    )
    name = "qwen3_next"
    dims: ClassVar[type[NextDims]] = NextDims
    quant_schemes = frozenset({"fp8_block"})
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "Qwen3-Next is published with fp8 blocks (quant_method fp8, weight_block_size), "
        "which shardprep converts"
    }
    kv_cache_scales = True

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        d = self.dims.counted(config)
        return [d.expert_count(), Count(d.mtp_key, d.mtp, d.mtp)]

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        return quantized_weights(shapes, "model.layers.")

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        d = self.dims(config)
        shapes = {
            f"model.layers.{i}.{suffix}": shape
            for i, kind in enumerate(d.layer_types)
            for suffix, shape in d.layer_shapes_of(i, kind).items()
        }
        shapes[EMBED] = (d.vocab, d.hidden)
        shapes[NORM] = (d.hidden,)
        shapes[HEAD] = (d.vocab, d.hidden)
        return shapes

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        return [name for name in shapes if name.startswith("mtp.")]

    def internal_draft(self, config: Config) -> str | None:
        """vLLM serves the `mtp.*` layers as the `mtp` draft; it assumes one MTP layer when
        config.json names none (`num_nextn_predict_layers`)."""
        return "mtp" if self.dims.counted(config).mtp else None

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        attention_bias = bool(config.get("attention_bias", False))
        return self.dims(config).problems(tp, ctx, attention_bias)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d = self.dims(config)
        params: list[Param] = []
        for layer, kind in enumerate(d.layer_types):
            prefix = f"model.layers.{layer}."
            stage = topology.stage_of_layer(layer)
            params += d.layer_params_of(layer, kind, prefix, prefix, stage)
        every = tuple(range(topology.pp))
        params.append(Param(EMBED, (Piece(EMBED, Cut.VOCAB),), every))
        params.append(Param(HEAD, (Piece(HEAD, Cut.VOCAB),), every))
        params.append(Param(NORM, (Piece(NORM, Cut.REPLICATE),), (topology.last_stage,)))
        return Layout(tuple(params), num_experts=d.experts)
