"""The Llama family (Llama, Mistral, Qwen2, Qwen3) and its EAGLE and EAGLE3 drafts.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, keeps global layer
indices in names, puts the embedding on the first stage (and on the last when tied or
when an EAGLE-style draft runs with pp > 1), and the final norm and lm_head on the last.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_int,
)
from shardprep.plan.archs.parts.dense import (
    LAYER,
    Dims,
    dense_layers,
    layer_params,
    linear_weights,
    skipped_suffixes,
)
from shardprep.plan.archs.parts.eagle import EagleBase, draft_dims
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology


class LlamaFamily(Family):
    name = "llama"
    draft_embedding = "model.embed_tokens.weight"  # for an EAGLE-style draft at pp > 1
    quant_schemes = frozenset({"fp8_block", "fp8_tensor", "fp8_ct", "nvfp4_pack", "modelopt_fp4"})
    kv_cache_scales = True

    def _variant(self, config: Config) -> tuple[bool, bool]:
        arch = (config.get("architectures") or [""])[0]
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False))
        return qkv_bias, arch == "Qwen3ForCausalLM"

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
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

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        return Dims(config).check(tp)

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        return linear_weights(shapes)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        dims = Dims(config)
        last = topology.last_stage
        params: list[Param] = []
        for index, names in sorted(dense_layers(shapes, LAYER).items()):
            stage = topology.stage_of_layer(index)
            prefix = f"model.layers.{index}."
            params += layer_params(names, prefix, prefix, dims, stage)
        # vLLM builds the embedding on the last stage too when it is tied to lm_head (and
        # when an EAGLE-style draft there shares it: `draft_embedding`).
        embed_stages = sorted({0, last} if dims.tied else {0})
        embed = Piece("model.embed_tokens.weight", Cut.VOCAB)
        params.append(Param("model.embed_tokens.weight", (embed,), tuple(embed_stages)))
        params.append(
            Param("model.norm.weight", (Piece("model.norm.weight", Cut.REPLICATE),), (last,))
        )
        skipped = skipped_suffixes(shapes, LAYER)
        if dims.tied:
            if "lm_head.weight" in shapes:
                skipped["lm_head.weight"] = "tied to model.embed_tokens.weight"
        else:
            params.append(Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), (last,)))
        return Layout(tuple(params), skipped)


class EagleDraft(EagleBase):
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

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        dims = draft_dims(config, ctx.target_config)
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


class Eagle3Draft(EagleBase):
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

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        layout = super().layout(config, shapes, topology, ctx)
        target_vocab = ctx.target_config.get("vocab_size")
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

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        target = ctx.target_config
        dims = draft_dims(config, target)
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
