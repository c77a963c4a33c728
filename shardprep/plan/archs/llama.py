"""The Llama family (Llama, Mistral, Qwen2, Qwen3) and its EAGLE and EAGLE3 drafts.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, keeps global layer
indices in names, puts the embedding on the first stage (and on the last when tied or
when an EAGLE-style draft runs with pp > 1), and the final norm and lm_head on the last.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, ClassVar

from shardprep.plan.archs.base import (
    Config,
    DraftFamily,
    Family,
    Layout,
    Param,
    Shapes,
    config_int,
)
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology, pad_vocab

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


def _group_layers(names: Iterable[str], pattern: re.Pattern[str]) -> dict[int, list[str]]:
    layers: dict[int, list[str]] = {}
    for name in names:
        match = pattern.match(name)
        if match and match.group(2) in _RULES:
            layers.setdefault(int(match.group(1) or 0), []).append(name)
    return layers


def _skipped(names: Iterable[str], pattern: re.Pattern[str]) -> dict[str, str]:
    skipped = {}
    for name in names:
        match = pattern.match(name)
        if match and match.group(2) in SKIPPED_SUFFIXES:
            skipped[name] = SKIPPED_SUFFIXES[match.group(2)]
    return skipped


TARGET_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def linear_weights(names: Iterable[str]) -> dict[str, str]:
    """{source weight: vLLM layer} of the attention and dense MLP projections
    (`q_proj` belongs to `qkv_proj`, `gate_proj` to `gate_up_proj`)."""
    found = {}
    for name in names:
        match = TARGET_LAYER.match(name)
        if match and match.group(2) in LINEAR_SUFFIXES:
            layer = _RULES[match.group(2)][0].removesuffix(".weight")
            found[name] = f"model.layers.{match.group(1)}.{layer}"
    return found


class LlamaFamily(Family):
    name = "llama"
    quant_schemes = frozenset({"fp8_block", "fp8_tensor", "fp8_ct", "nvfp4_pack", "modelopt_fp4"})
    kv_cache_scales = True

    def _variant(self, config: Config) -> tuple[bool, bool]:
        arch = (config.get("architectures") or [""])[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False))
        return qkv_bias, arch == "Qwen3ForCausalLM"

    def expected_shapes(self, config: Config, **context: Any) -> dict[str, tuple[int, ...]]:
        dims = Dims(config)
        qkv_bias, qk_norm = self._variant(config)
        layer = dims.layer_shapes(qkv_bias, qk_norm, dims.hidden)
        shapes = {
            f"model.layers.{i}.{suffix}": shape
            for i in range(dims.layers)
            for suffix, shape in layer.items()
        }
        shapes["model.embed_tokens.weight"] = (dims.vocab, dims.hidden)
        shapes["model.norm.weight"] = (dims.hidden,)
        if not dims.tied:
            shapes["lm_head.weight"] = (dims.vocab, dims.hidden)
        return shapes

    def check(self, config: Config, tp: int, **context: Any) -> list[str]:
        return Dims(config).check(tp)

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        return linear_weights(shapes)

    def layout(self, config: Config, shapes: Shapes, topology: Topology, **context: Any) -> Layout:
        dims = Dims(config)
        last = topology.last_stage
        params: list[Param] = []
        for index, names in sorted(_group_layers(shapes, TARGET_LAYER).items()):
            stage = topology.stage_of_layer(index)
            prefix = f"model.layers.{index}."
            params += layer_params(names, prefix, prefix, dims, stage)
        # vLLM builds the embedding on the last stage too when it is tied to lm_head, or
        # when an EAGLE-style draft there needs the target's embedding.
        draft_embed = bool(context.get("with_draft")) and topology.pp > 1
        embed_stages = sorted({0} | ({last} if dims.tied or draft_embed else set()))
        embed = Piece("model.embed_tokens.weight", Cut.VOCAB)
        params.append(Param("model.embed_tokens.weight", (embed,), tuple(embed_stages)))
        params.append(
            Param("model.norm.weight", (Piece("model.norm.weight", Cut.REPLICATE),), (last,))
        )
        skipped = _skipped(shapes, TARGET_LAYER)
        if dims.tied:
            if "lm_head.weight" in shapes:
                skipped["lm_head.weight"] = "tied to model.embed_tokens.weight"
        else:
            params.append(Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), (last,)))
        optional: frozenset[tuple[str, int]] = frozenset()
        if draft_embed and not dims.tied:
            optional = frozenset({("model.embed_tokens.weight", last)})
        return Layout(tuple(params), skipped, spec_decode_only=optional)


def _draft_dims(config: Config, target: Config) -> Dims:
    merged = {**target, **{k: v for k, v in config.items() if v is not None}}
    return Dims(merged)


class _EagleBase(DraftFamily):
    """What EAGLE and EAGLE3 drafts share: layers named `model.layers.{i}` (vLLM renames
    only the attention prefix after the target's layers), everything on the last stage,
    embedding and lm_head optional (vLLM shares the target's when absent)."""

    layer_pattern: ClassVar[re.Pattern[str]]
    top_level: ClassVar[dict[str, tuple[str, Cut]]]
    skipped_names: ClassVar[dict[str, str]] = {}
    optional_sources: ClassVar[frozenset[str]] = frozenset({"embed_tokens.weight"})
    # Index tables vLLM holds as integers (draft-to-target token ids: torch.long).
    integer_tables: ClassVar[dict[str, str]] = {"d2t": "I64"}

    def check(self, config: Config, tp: int, **context: Any) -> list[str]:
        return _draft_dims(config, context.get("target_config", {})).check(tp)

    def layout(self, config: Config, shapes: Shapes, topology: Topology, **context: Any) -> Layout:
        dims = _draft_dims(config, context.get("target_config", {}))
        last = topology.last_stage
        skipped = {n: r for n, r in self.skipped_names.items() if n in shapes}
        kept = [name for name in shapes if name not in skipped]
        params: list[Param] = []
        for index, names in sorted(_group_layers(kept, self.layer_pattern).items()):
            hf_prefix = self._layer_prefix(names[0])
            params += layer_params(names, hf_prefix, f"model.layers.{index}.", dims, last)
        for hf, (vllm, cut) in self.top_level.items():
            if hf in shapes and hf not in skipped:
                dtype = self.integer_tables.get(hf)
                params.append(Param(vllm, (Piece(hf, cut),), (last,), dtype))
        return Layout(
            tuple(params),
            skipped,
            shared_with_target=frozenset({"model.embed_tokens.weight", "lm_head.weight"}),
            optional_sources=self.optional_sources,
        )

    def after_fill(self, model: Any, filled: set[str]) -> None:
        """What EAGLE-style `load_weights` sets as a side effect: `has_own_lm_head` and
        `has_own_embed_tokens` when the draft's files hold them (else vLLM shares the
        target's modules)."""
        from vllm.model_executor.models.utils import process_eagle_weight

        for name in sorted(filled):
            process_eagle_weight(model, name)

    def _layer_prefix(self, name: str) -> str:
        match = self.layer_pattern.match(name)
        assert match
        return name[: match.start(2)]


class EagleDraft(_EagleBase):
    """EAGLE-1 heads (`fc` over [embedding, hidden], then Llama layers; no lm_head)."""

    name = "eagle"
    layer_pattern = re.compile(r"^layers\.(\d+)\.(.+)$")
    top_level: ClassVar[dict[str, tuple[str, Cut]]] = {
        "embed_tokens.weight": ("model.embed_tokens.weight", Cut.VOCAB),
        "fc.weight": ("model.fc.weight", Cut.REPLICATE),
    }
    skipped_names: ClassVar[dict[str, str]] = {
        "layers.0.input_layernorm.weight": "vLLM's EAGLE layer 0 has no input norm"
    }

    def recognizes(self, config: Config, names: list[str]) -> bool:
        # A top-level hidden_norm belongs to DFlash-style drafts.
        return (
            "fc.weight" in names
            and "hidden_norm.weight" not in names
            and any(n.startswith("layers.") for n in names)
        )

    def expected_shapes(self, config: Config, **context: Any) -> dict[str, tuple[int, ...]]:
        dims = _draft_dims(config, context.get("target_config", {}))
        layer = dims.layer_shapes(False, False, dims.hidden)
        shapes = {
            f"layers.{i}.{suffix}": shape
            for i in range(dims.layers)
            for suffix, shape in layer.items()
        }
        shapes.pop("layers.0.input_layernorm.weight")
        shapes["fc.weight"] = (dims.hidden, 2 * dims.hidden)
        shapes["embed_tokens.weight"] = (dims.vocab, dims.hidden)
        return shapes


class Eagle3Draft(_EagleBase):
    """EAGLE-3 heads: one `midlayer` over [norm(embedding), norm(hidden)], `fc` over three
    auxiliary target states, its own (possibly smaller) vocabulary with `d2t`."""

    name = "eagle3"
    layer_pattern = re.compile(r"^(?:midlayer|layers\.(\d+))\.(.+)$")
    top_level: ClassVar[dict[str, tuple[str, Cut]]] = {
        "embed_tokens.weight": ("model.embed_tokens.weight", Cut.VOCAB),
        "fc.weight": ("model.fc.weight", Cut.REPLICATE),
        "norm.weight": ("model.norm.weight", Cut.REPLICATE),
        "lm_head.weight": ("lm_head.weight", Cut.VOCAB),
        "d2t": ("draft_id_to_target_id", Cut.REPLICATE),
    }
    skipped_names: ClassVar[dict[str, str]] = {"t2d": "vLLM does not use the target-to-draft table"}
    optional_sources: ClassVar[frozenset[str]] = frozenset({"embed_tokens.weight", "t2d", "d2t"})

    def recognizes(self, config: Config, names: list[str]) -> bool:
        if "hidden_norm.weight" in names:  # top-level: a DFlash-style draft
            return False
        return any(n.startswith("midlayer.") for n in names) or "d2t" in names

    def layout(self, config: Config, shapes: Shapes, topology: Topology, **context: Any) -> Layout:
        layout = super().layout(config, shapes, topology, **context)
        target_vocab = context.get("target_config", {}).get("vocab_size")
        if "d2t" in shapes and self._draft_vocab(config) == target_vocab:
            params = tuple(p for p in layout.params if p.name != "draft_id_to_target_id")
            skipped = {**layout.skipped, "d2t": "the draft vocabulary equals the target's"}
            return dataclasses.replace(layout, params=params, skipped=skipped)
        return layout

    @staticmethod
    def _draft_vocab(config: Config) -> int:
        if config.get("draft_vocab_size") is not None:
            return config_int(config, "draft_vocab_size")
        return config_int(config, "vocab_size")

    def expected_shapes(self, config: Config, **context: Any) -> dict[str, tuple[int, ...]]:
        target = context.get("target_config", {})
        dims = _draft_dims(config, target)
        target_hidden = config_int(
            config, "target_hidden_size", config_int(target, "hidden_size", dims.hidden)
        )
        aux = config_int(config, "num_aux_hidden_states", 3)
        layer = dims.layer_shapes(False, False, 2 * dims.hidden)
        layer["hidden_norm.weight"] = (dims.hidden,)
        shapes = {f"midlayer.{suffix}": shape for suffix, shape in layer.items()}
        draft_vocab = self._draft_vocab(config)
        shapes |= {
            "fc.weight": (dims.hidden, aux * target_hidden),
            "norm.weight": (dims.hidden,),
            "lm_head.weight": (draft_vocab, dims.hidden),
            "d2t": (draft_vocab,),
            "t2d": (dims.vocab,),
        }
        return shapes

    def example_tables(self, config: Config, *, target_config: Config, seed: int) -> dict:
        """Valid `d2t`/`t2d` tables for a random draft vocabulary (for tiny models)."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        vocab, draft_vocab = int(target_config["vocab_size"]), self._draft_vocab(config)
        chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        return {"d2t": chosen - torch.arange(draft_vocab), "t2d": t2d}

    def _layer_prefix(self, name: str) -> str:
        return "midlayer." if name.startswith("midlayer.") else super()._layer_prefix(name)
