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

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.archs.base import (
    Config,
    Count,
    Family,
    Layout,
    Param,
    Shapes,
    config_count,
    config_int,
    expert_count,
    moe_layers,
)
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.experts import w2_pieces, w13_pieces
from shardprep.plan.topology import Topology, pad_vocab

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
F32 = "F32"


@dataclass(frozen=True)
class Dims:
    """The sizes config.json implies, under their Hugging Face names."""

    hidden: int
    heads: int
    q_lora: int | None
    kv_lora: int
    nope: int
    rope: int
    v: int
    intermediate: int
    moe_intermediate: int
    experts: int
    shared: int
    first_dense: int
    moe_freq: int
    vocab: int
    layers: int
    noaux_bias: bool
    tied: bool

    @classmethod
    def of(cls, config: Config) -> Dims:
        experts = config.get("n_routed_experts")
        return cls(
            hidden=int(config["hidden_size"]),
            heads=int(config["num_attention_heads"]),
            q_lora=int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
            kv_lora=int(config["kv_lora_rank"]),
            nope=int(config["qk_nope_head_dim"]),
            rope=int(config["qk_rope_head_dim"]),
            v=int(config["v_head_dim"]),
            intermediate=int(config["intermediate_size"]),
            moe_intermediate=int(config.get("moe_intermediate_size") or 0),
            experts=int(experts or 0),
            shared=int(config.get("n_shared_experts") or 0),
            first_dense=int(config.get("first_k_dense_replace") or 0),
            moe_freq=int(config.get("moe_layer_freq") or 1),
            vocab=int(config["vocab_size"]),
            layers=int(config["num_hidden_layers"]),
            noaux_bias=config.get("topk_method") == "noaux_tc",
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    def moe_layers(self, layers: range) -> int:
        """How many of `layers` hold experts."""
        return moe_layers(layers, self.first_dense, self.moe_freq) if self.experts else 0

    def is_moe(self, layer: int) -> bool:
        """vLLM's `is_moe_layer`."""
        return bool(self.experts) and layer >= self.first_dense and layer % self.moe_freq == 0


@dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor of a layer: where it goes in vLLM and how it is cut."""

    hf: str  # suffix inside the layer
    shape: tuple[int, ...]
    cut: Cut
    linear: bool = False  # a linear layer's weight, which takes the model's quantization
    fused: str = ""  # the vLLM parameter it is a piece of, when not its own name
    dtype: str | None = None

    @property
    def vllm(self) -> str:
        return self.fused or self.hf


def attention_tensors(d: Dims) -> list[Tensor]:
    qk, a = d.nope + d.rope, "self_attn."
    kv_a = (d.kv_lora + d.rope, d.hidden)
    if d.q_lora is not None:
        fused = a + "fused_qkv_a_proj.weight"
        q = [
            Tensor(a + "q_a_proj.weight", (d.q_lora, d.hidden), Cut.REPLICATE, True, fused),
            Tensor(a + "kv_a_proj_with_mqa.weight", kv_a, Cut.REPLICATE, True, fused),
            Tensor(a + "q_a_layernorm.weight", (d.q_lora,), Cut.REPLICATE),
            Tensor(a + "q_b_proj.weight", (d.heads * qk, d.q_lora), Cut.ROWS, True),
        ]
    else:
        q = [
            Tensor(a + "q_proj.weight", (d.heads * qk, d.hidden), Cut.ROWS, True),
            Tensor(a + "kv_a_proj_with_mqa.weight", kv_a, Cut.REPLICATE, True),
        ]
    return [
        *q,
        Tensor(a + "kv_a_layernorm.weight", (d.kv_lora,), Cut.REPLICATE),
        Tensor(a + "kv_b_proj.weight", (d.heads * (d.nope + d.v), d.kv_lora), Cut.ROWS, True),
        Tensor(a + "o_proj.weight", (d.hidden, d.heads * d.v), Cut.COLS, True),
    ]


def mlp_tensors(prefix: str, hidden: int, intermediate: int) -> list[Tensor]:
    """A dense MLP (or DeepSeek's shared experts): gate and up fused, down by columns."""
    fused = prefix + "gate_up_proj.weight"
    return [
        Tensor(prefix + "gate_proj.weight", (intermediate, hidden), Cut.ROWS, True, fused),
        Tensor(prefix + "up_proj.weight", (intermediate, hidden), Cut.ROWS, True, fused),
        Tensor(prefix + "down_proj.weight", (hidden, intermediate), Cut.COLS, True),
    ]


def layer_tensors(d: Dims, layer: int) -> list[Tensor]:
    """Every tensor of one decoder layer but the routed experts, in vLLM's fusion order."""
    norms = [
        Tensor(name, (d.hidden,), Cut.REPLICATE)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight")
    ]
    if not d.is_moe(layer):
        return [*attention_tensors(d), *mlp_tensors("mlp.", d.hidden, d.intermediate), *norms]
    moe = [Tensor("mlp.gate.weight", (d.experts, d.hidden), Cut.REPLICATE)]
    if d.noaux_bias:
        bias = "mlp.gate.e_score_correction_bias"
        moe.append(Tensor(bias, (d.experts,), Cut.REPLICATE, dtype=F32))
    if d.shared:
        moe += mlp_tensors("mlp.shared_experts.", d.hidden, d.moe_intermediate * d.shared)
    return [*attention_tensors(d), *moe, *norms]


def expert_shapes(d: Dims) -> dict[str, tuple[int, int]]:
    """The tensors of one routed expert, under `mlp.experts.{e}.`."""
    return {
        "gate_proj.weight": (d.moe_intermediate, d.hidden),
        "up_proj.weight": (d.moe_intermediate, d.hidden),
        "down_proj.weight": (d.hidden, d.moe_intermediate),
    }


def layer_sources(d: Dims, layer: int) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """{Hugging Face name: (shape, fixed dtype)} of one decoder layer's tensors, routed
    experts included."""
    prefix = f"model.layers.{layer}."
    found = {prefix + t.hf: (t.shape, t.dtype) for t in layer_tensors(d, layer)}
    if d.is_moe(layer):
        for e in range(d.experts):
            for suffix, shape in expert_shapes(d).items():
                found[f"{prefix}mlp.experts.{e}.{suffix}"] = (shape, None)
    return found


def layer_quantized(d: Dims, layer: int) -> dict[str, str]:
    """{source weight: vLLM layer} of one decoder layer's linear layers and experts (the
    router is never quantized: vLLM builds it without the model's quantization)."""
    prefix = f"model.layers.{layer}."
    found = {
        prefix + t.hf: prefix + t.vllm.removesuffix(".weight")
        for t in layer_tensors(d, layer)
        if t.linear
    }
    if d.is_moe(layer):
        for e in range(d.experts):
            for suffix in expert_shapes(d):
                found[f"{prefix}mlp.experts.{e}.{suffix}"] = f"{prefix}mlp.experts"
    return found


def split_problems(d: Dims, tp: int) -> list[str]:
    sizes = [("num_attention_heads", d.heads)]
    if d.first_dense or d.moe_freq > 1 or not d.experts:
        sizes.append(("intermediate_size", d.intermediate))
    if d.experts:
        sizes.append(("moe_intermediate_size", d.moe_intermediate))
    if d.experts and d.shared:
        sizes.append(("moe_intermediate_size x n_shared_experts", d.moe_intermediate * d.shared))
    sizes.append(("the vocabulary padded to 64", pad_vocab(d.vocab)))
    return [
        f"{what} ({size}) is not divisible by tp={tp}; choose a tp that divides it"
        for what, size in sizes
        if size % tp
    ]


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

    def counts(self, config: Config, **context: Any) -> list[Count]:
        config_int(config, "moe_layer_freq", 1)  # vLLM divides by it
        for key in ("first_k_dense_replace", "n_shared_experts", "n_routed_experts"):
            config_count(config, key)
        mtp = config_count(config, "num_nextn_predict_layers")
        d = self.dims(config)
        experts = expert_count(config, "n_routed_experts", d.moe_layers(range(d.layers)))
        return [experts, Count("num_nextn_predict_layers", mtp, mtp)]

    def expected_shapes(self, config: Config, **context: Any) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._sources(config).items()}

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

    def check(self, config: Config, tp: int, **context: Any) -> list[str]:
        try:
            d = self.dims(config)
        except (KeyError, ValueError, TypeError):
            return []  # expected_shapes reports what config.json lacks
        problems = []
        if d.tied:
            problems.append("tie_word_embeddings is not supported for DeepSeek models")
        if d.shared and context.get("expert_parallel") and tp > 1 and context.get("dp", 1) > 1:
            # vLLM's sequence-parallel MoE (`use_sequence_parallel_moe`) then replicates them.
            problems.append(
                "with --enable-expert-parallel, tp > 1 and dp > 1 vLLM replicates the shared "
                "experts, a layout shardprep does not write yet; use --tp 1 or --dp 1"
            )
        return problems + split_problems(d, tp)

    def layout(self, config: Config, shapes: Shapes, topology: Topology, **context: Any) -> Layout:
        d = self.dims(config)
        last = topology.last_stage
        params: list[Param] = []
        skipped: dict[str, str] = {}
        mtp = (
            "an MTP layer, which the MTP draft holds"
            if context.get("draft_method") == "mtp"
            else "an MTP layer; vLLM loads it only as the MTP draft, which --no-mtp or "
            "another --draft leaves out"
        )
        for name in shapes:
            match = LAYER.match(name)
            if match and int(match[1]) >= d.layers:
                skipped[name] = mtp
        for layer in range(d.layers):
            stage = topology.stage_of_layer(layer)
            prefix = f"model.layers.{layer}."
            params += fused_params(self.layer_params(d, layer, prefix), stage)
        vocab = Piece("model.embed_tokens.weight", Cut.VOCAB)
        params.append(Param("model.embed_tokens.weight", (vocab,), (0,)))
        norm = Piece("model.norm.weight", Cut.REPLICATE)
        params.append(Param("model.norm.weight", (norm,), (last,)))
        params.append(Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), (last,)))
        return Layout(tuple(params), skipped, num_experts=d.experts)

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


def fused_params(entries: Iterator[tuple[str, Piece, str | None]], stage: int) -> list[Param]:
    pieces: dict[str, list[Piece]] = {}
    dtypes: dict[str, str | None] = {}
    for name, piece, dtype in entries:
        pieces.setdefault(name, []).append(piece)
        dtypes[name] = dtype
    return [Param(name, tuple(p), (stage,), dtypes[name]) for name, p in pieces.items()]
