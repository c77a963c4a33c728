"""The dense decoder layer of the Llama lineage (Llama, Mistral, Qwen2, Qwen3), which MoE
families and EAGLE-style drafts build on: each attention and MLP tensor's vLLM name and
cut (q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`), the sizes that must split
by tp, and the linear layers a quantization applies to.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from shardprep.plan.archs.base import Config, Param, config_int
from shardprep.plan.archs.parts.names import LAYER
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import pad_vocab

# (Hugging Face suffix inside a layer, vLLM suffix, how it is cut). Pieces of a fused
# vLLM parameter appear in the order vLLM stacks them.
LAYER_TENSORS: tuple[tuple[str, str, str], ...] = (
    ("self_attn.q_proj.weight", "self_attn.qkv_proj.weight", "q"),
    ("self_attn.k_proj.weight", "self_attn.qkv_proj.weight", "kv"),
    ("self_attn.v_proj.weight", "self_attn.qkv_proj.weight", "kv"),
    ("self_attn.q_proj.bias", "self_attn.qkv_proj.bias", "q"),
    ("self_attn.k_proj.bias", "self_attn.qkv_proj.bias", "kv"),
    ("self_attn.v_proj.bias", "self_attn.qkv_proj.bias", "kv"),
    ("self_attn.o_proj.weight", "self_attn.o_proj.weight", "cols"),
    ("self_attn.o_proj.bias", "self_attn.o_proj.bias", "rep"),
    ("self_attn.q_norm.weight", "self_attn.q_norm.weight", "rep"),
    ("self_attn.k_norm.weight", "self_attn.k_norm.weight", "rep"),
    ("mlp.gate_proj.weight", "mlp.gate_up_proj.weight", "rows"),
    ("mlp.up_proj.weight", "mlp.gate_up_proj.weight", "rows"),
    ("mlp.gate_proj.bias", "mlp.gate_up_proj.bias", "rows"),
    ("mlp.up_proj.bias", "mlp.gate_up_proj.bias", "rows"),
    ("mlp.down_proj.weight", "mlp.down_proj.weight", "cols"),
    ("mlp.down_proj.bias", "mlp.down_proj.bias", "rep"),
    ("input_layernorm.weight", "input_layernorm.weight", "rep"),
    ("hidden_norm.weight", "hidden_norm.weight", "rep"),  # EAGLE3 only
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight", "rep"),
)
_RULES = {hf: (vllm, cut) for hf, vllm, cut in LAYER_TENSORS}
LINEAR_SUFFIXES = frozenset(hf for hf, _, _ in LAYER_TENSORS if hf.endswith("_proj.weight"))
_ORDER = {hf: i for i, (hf, _, _) in enumerate(LAYER_TENSORS)}
SKIPPED_SUFFIXES = {"self_attn.rotary_emb.inv_freq": "rotary tables are computed by vLLM"}


class Dims:
    """The sizes config.json implies, under their Hugging Face names."""

    def __init__(self, config: Config) -> None:
        self.hidden = config_int(config, "hidden_size")
        self.heads = config_int(config, "num_attention_heads")
        self.kv_heads = config_int(config, "num_key_value_heads", self.heads)
        self.head_dim = config_int(config, "head_dim", max(1, self.hidden // self.heads))
        self.intermediate = config_int(config, "intermediate_size")
        self.vocab = config_int(config, "vocab_size")
        self.layers = config_int(config, "num_hidden_layers")
        self.tied = bool(config.get("tie_word_embeddings", False))

    def layer_shapes(self, qkv_bias: bool, qk_norm: bool, attn_in: int) -> dict[str, tuple]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "self_attn.q_proj.weight": (q, attn_in),
            "self_attn.k_proj.weight": (kv, attn_in),
            "self_attn.v_proj.weight": (kv, attn_in),
            "self_attn.o_proj.weight": (self.hidden, q),
            "mlp.gate_proj.weight": (self.intermediate, self.hidden),
            "mlp.up_proj.weight": (self.intermediate, self.hidden),
            "mlp.down_proj.weight": (self.hidden, self.intermediate),
            "input_layernorm.weight": (self.hidden,),
            "post_attention_layernorm.weight": (self.hidden,),
        }
        if qkv_bias:
            shapes |= {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
            }
        if qk_norm:
            shapes |= {
                "self_attn.q_norm.weight": (self.head_dim,),
                "self_attn.k_norm.weight": (self.head_dim,),
            }
        return shapes

    def check(self, tp: int) -> list[str]:
        return self.check_attention(tp) + self.check_intermediate(tp) + self.check_vocab(tp)

    def check_attention(self, tp: int) -> list[str]:
        problems = []
        if self.heads % tp:
            problems.append(
                f"num_attention_heads ({self.heads}) is not divisible by tp={tp}; "
                "choose a tp that divides it"
            )
        if (tp < self.kv_heads and self.kv_heads % tp) or (
            tp >= self.kv_heads and tp % self.kv_heads
        ):
            problems.append(
                f"num_key_value_heads ({self.kv_heads}) and tp={tp} do not divide one another; "
                "choose a tp that divides or is a multiple of the KV heads"
            )
        return problems

    def check_intermediate(self, tp: int) -> list[str]:
        if self.intermediate % tp:
            return [
                f"intermediate_size ({self.intermediate}) is not divisible by tp={tp}; "
                "choose a tp that divides it"
            ]
        return []

    def check_vocab(self, tp: int) -> list[str]:
        if pad_vocab(self.vocab) % tp:
            return [
                f"the vocabulary padded to 64 ({pad_vocab(self.vocab)}) is not divisible by "
                f"tp={tp}; choose a tp that divides it"
            ]
        return []


def _piece(source: str, cut: str, dims: Dims) -> Piece:
    kinds = {"q": Cut.ROWS, "rows": Cut.ROWS, "cols": Cut.COLS, "rep": Cut.REPLICATE}
    if cut == "kv":
        return Piece(source, Cut.KV_HEADS, heads=dims.kv_heads)
    return Piece(source, kinds[cut])


def layer_params(
    names: Iterable[str], hf_prefix: str, vllm_prefix: str, dims: Dims, stage: int
) -> list[Param]:
    """Fuse the tensors of one layer into vLLM's parameters, in vLLM's stacking order."""
    fused: dict[str, list[Piece]] = {}
    for name in sorted(names, key=lambda n: _ORDER[n.removeprefix(hf_prefix)]):
        vllm_suffix, cut = _RULES[name.removeprefix(hf_prefix)]
        fused.setdefault(vllm_prefix + vllm_suffix, []).append(_piece(name, cut, dims))
    return [Param(name, tuple(pieces), (stage,)) for name, pieces in fused.items()]


def dense_layers(names: Iterable[str], pattern: re.Pattern[str]) -> dict[int, list[str]]:
    layers: dict[int, list[str]] = {}
    for name in names:
        match = pattern.match(name)
        if match and match.group(2) in _RULES:
            layers.setdefault(int(match.group(1) or 0), []).append(name)
    return layers


def skipped_suffixes(names: Iterable[str], pattern: re.Pattern[str]) -> dict[str, str]:
    skipped = {}
    for name in names:
        match = pattern.match(name)
        if match and match.group(2) in SKIPPED_SUFFIXES:
            skipped[name] = SKIPPED_SUFFIXES[match.group(2)]
    return skipped


def linear_weights(names: Iterable[str]) -> dict[str, str]:
    """{source weight: vLLM layer} of the attention and dense MLP projections
    (`q_proj` belongs to `qkv_proj`, `gate_proj` to `gate_up_proj`)."""
    found = {}
    for name in names:
        match = LAYER.match(name)
        if match and match.group(2) in LINEAR_SUFFIXES:
            layer = _RULES[match.group(2)][0].removesuffix(".weight")
            found[name] = f"model.layers.{match.group(1)}.{layer}"
    return found
