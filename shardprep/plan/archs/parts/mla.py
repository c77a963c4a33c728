"""MLA (multi-head latent attention) as DeepSeek-V2 and V3 publish it, and the parts of a
DeepSeek-style decoder layer other families build on: the sizes config.json implies, the
tensors of one layer (attention, dense MLP or shared and routed experts, norms) with their
vLLM names and cuts, and the fusion of pieces into vLLM parameters.

vLLM (`deepseek_v2.py`) fuses `q_a_proj` and `kv_a_proj_with_mqa` into a replicated
`fused_qkv_a_proj` when `q_lora_rank` is set, splits `q_b_proj`/`q_proj`/`kv_b_proj` by
whole heads and `o_proj` by columns, splits shared experts like a dense MLP and keeps the
router and its `e_score_correction_bias` (float32) whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from shardprep.plan.archs.base import Config, Param, config_int, moe_layers
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import pad_vocab

F32 = "F32"


# The MLA sizes by their field names, under config.json's keys.
MLA_KEYS = {
    "q_lora": "q_lora_rank",
    "kv_lora": "kv_lora_rank",
    "nope": "qk_nope_head_dim",
    "rope": "qk_rope_head_dim",
    "v": "v_head_dim",
}


def mla_sizes(config: Config) -> dict[str, int]:
    """The MLA sizes of a model that needs every one of them (a low-rank query too), each
    a required count of config.json (DeepSeek's `Dims` allows no `q_lora_rank`)."""
    return {field: config_int(config, key) for field, key in MLA_KEYS.items()}


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
    groups: int  # of grouped routing (n_group): vLLM places experts round robin only then

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
            groups=int(config.get("n_group") or 1),
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


def fused_params(entries: Iterator[tuple[str, Piece, str | None]], stage: int) -> list[Param]:
    pieces: dict[str, list[Piece]] = {}
    dtypes: dict[str, str | None] = {}
    for name, piece, dtype in entries:
        pieces.setdefault(name, []).append(piece)
        dtypes[name] = dtype
    return [Param(name, tuple(p), (stage,), dtypes[name]) for name, p in pieces.items()]
