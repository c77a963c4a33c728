"""Kimi-K2.5 and Kimi-K2.6 (`KimiK25ForConditionalGeneration`, vLLM's `kimi_k25.py` and
`kimi_k25_vit.py`): DeepSeek-V3's text model under `language_model.`, a MoonViT vision
tower and its projector.

The text model is DeepSeek-V3's (`DeepseekFamily`'s rules, every name under
`language_model.`, as published and as vLLM names its parameters); config.json holds it
under `text_config`, which `read_config` brings to the top as vLLM's `hf_text_config`
reads it. vLLM serves no MTP draft for this architecture (its speculative config turns
only DeepSeek model types into MTP drafts), so MTP layers, if any, are skipped.

vLLM builds the vision tower and the projector on every pipeline stage (its `__init__`
asks nothing of the stage) in the model's dtype, never quantized (a compressed-tensors
quantization is dropped for them), and loads them there:

- each encoder block's `wqkv` [3 x hidden, hidden] (and bias) is a QKVParallelLinear given
  the fused tensor: the rank's rows of q, then of k, then of v; `wo` by columns (its bias
  whole); `mlp.fc0` by rows (and bias), `mlp.fc1` by columns (its bias whole); norms,
  `patch_embed` (the 4-D conv weight, the position embedding) and the final layernorm
  whole. vLLM's `is_vit_use_data_parallel` replicates all of it when tp does not divide
  the vision heads (and with `--mm-encoder-tp-mode data`, which these files do not serve);
- the projector: `mm_projector.pre_norm` whole, `mm_projector.proj.0/2` whole as vLLM's
  `linear_1/2` (ReplicatedLinear, weight and bias).

The vision config is read as transformers' `Kimi_K25VisionConfig` reads it (vLLM builds
the tower from it): `hidden_size`, `num_hidden_layers`, ... with that class's defaults;
the published config's `vt_*` keys are not read by it, so a `vt_*` size that differs
from what vLLM reads is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Count,
    Layout,
    Param,
    PlanContext,
    Shapes,
)
from shardprep.plan.archs.deepseek.v3 import DeepseekFamily
from shardprep.plan.archs.parts.moonvit import BLOCKS, PROJECTOR, VISION, tower_params
from shardprep.plan.cuts import Cut
from shardprep.plan.topology import Topology

TEXT = "language_model."
NO_MTP = (
    "an MTP layer, which vLLM does not load for KimiK25ForConditionalGeneration (it serves "
    "no MTP draft for this architecture)"
)
# The config keys that stay the top level's when the text config is brought up.
TOP_KEYS = ("architectures", "model_type", "quantization_config", "torch_dtype", "dtype")
# transformers' Kimi_K25VisionConfig defaults (what vLLM builds when a key is absent).
VISION_DEFAULTS: Mapping[str, Any] = {
    "hidden_size": 1152,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "intermediate_size": 4304,
    "patch_size": 14,
    "pos_emb_height": 64,
    "pos_emb_width": 64,
    "merge_kernel_size": (2, 2),
}
# The published config's own names of four of them, which transformers does not read.
LEGACY = {
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "vt_intermediate_size": "intermediate_size",
}


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's sizes as vLLM builds them."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    patch: int
    pos: tuple[int, int]
    merge: tuple[int, int]
    text_hidden: int

    @classmethod
    def of(cls, config: Config) -> VisionDims:
        vision = dict(VISION_DEFAULTS) | dict(config.get("vision_config") or {})
        merge = tuple(int(k) for k in vision["merge_kernel_size"])
        pos = tuple(
            int(vision.get(f"init_pos_emb_{d}") or vision[f"pos_emb_{d}"])
            for d in ("height", "width")
        )
        return cls(
            hidden=int(vision["hidden_size"]),
            layers=int(vision["num_hidden_layers"]),
            heads=int(vision["num_attention_heads"]),
            intermediate=int(vision["intermediate_size"]),
            patch=int(vision["patch_size"]),
            pos=(pos[0], pos[1]),
            merge=(merge[0], merge[1]),
            text_hidden=int(config["hidden_size"]),
        )

    def split(self, tp: int) -> bool:
        """Whether vLLM splits the tower by tp (`is_vit_use_data_parallel`)."""
        return self.heads % tp == 0

    def tensors(self) -> dict[str, tuple[tuple[int, ...], Cut]]:
        """{name: (shape, cut when the tower is split)} of the tower and the projector."""
        h, inter = self.hidden, self.intermediate
        merged = h * self.merge[0] * self.merge[1]
        found: dict[str, tuple[tuple[int, ...], Cut]] = {
            VISION + "patch_embed.proj.weight": ((h, 3, self.patch, self.patch), Cut.REPLICATE),
            VISION + "patch_embed.proj.bias": ((h,), Cut.REPLICATE),
            VISION + "patch_embed.pos_emb.weight": ((*self.pos, h), Cut.REPLICATE),
            VISION + "encoder.final_layernorm.weight": ((h,), Cut.REPLICATE),
            VISION + "encoder.final_layernorm.bias": ((h,), Cut.REPLICATE),
            PROJECTOR + "pre_norm.weight": ((h,), Cut.REPLICATE),
            PROJECTOR + "pre_norm.bias": ((h,), Cut.REPLICATE),
            PROJECTOR + "proj.0.weight": ((merged, merged), Cut.REPLICATE),
            PROJECTOR + "proj.0.bias": ((merged,), Cut.REPLICATE),
            PROJECTOR + "proj.2.weight": ((self.text_hidden, merged), Cut.REPLICATE),
            PROJECTOR + "proj.2.bias": ((self.text_hidden,), Cut.REPLICATE),
        }
        for i in range(self.layers):
            block = f"{BLOCKS}{i}."
            found |= {
                block + "wqkv.weight": ((3 * h, h), Cut.PARTS_ROWS),
                block + "wqkv.bias": ((3 * h,), Cut.PARTS_ROWS),
                block + "wo.weight": ((h, h), Cut.COLS),
                block + "wo.bias": ((h,), Cut.REPLICATE),
                block + "mlp.fc0.weight": ((inter, h), Cut.ROWS),
                block + "mlp.fc0.bias": ((inter,), Cut.ROWS),
                block + "mlp.fc1.weight": ((h, inter), Cut.COLS),
                block + "mlp.fc1.bias": ((h,), Cut.REPLICATE),
            }
            for norm in ("norm0", "norm1"):
                found |= {block + f"{norm}.{p}": ((h,), Cut.REPLICATE) for p in ("weight", "bias")}
        return found

    def params(self, tp: int, stages: tuple[int, ...]) -> list[Param]:
        return tower_params(self.tensors(), self.split(tp), stages)

    def problems(self, tp: int) -> list[str]:
        if not self.split(tp) or self.intermediate % tp == 0:
            return []
        return [
            f"the vision tower's intermediate_size ({self.intermediate}) is not divisible by "
            f"tp={tp}; choose a tp that divides it"
        ]


def vision_config_problems(config: Config) -> list[str]:
    """A published `vt_*` size that transformers (and so vLLM) would not read, and the
    vision tower variants whose weights these rules do not place."""
    vision = dict(config.get("vision_config") or {})
    problems = []
    for legacy, key in LEGACY.items():
        read = vision.get(key, VISION_DEFAULTS[key])
        if legacy in vision and vision[legacy] != read:
            problems.append(
                f"vision_config has {legacy}: {vision[legacy]} but vLLM reads {key} ({read}"
                f"{'' if key in vision else ', the default'}); set {key}: {vision[legacy]} "
                "in vision_config"
            )
    for key, supported in (("mm_projector_type", "patchmerger"), ("norm_type", "layernorm")):
        if vision.get(key, supported) != supported:
            problems.append(
                f"vision_config has {key}: {vision[key]!r}; shardprep places the vision "
                f"tower of Kimi-K2.5 and K2.6 ({key} {supported!r}) only"
            )
    return problems


class KimiK25Family(DeepseekFamily):
    name = "kimi_k25"
    # As published (int4 experts) and the other compressed-tensors schemes, under which
    # vLLM builds the vision tower and projector unquantized; no fp8.
    quant_schemes = frozenset({"int4_pack", "mxfp4_pack", "nvfp4_pack"})
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "shardprep's layout of them is not proven against vLLM, which quantizes the "
        "vision tower and projector too unless the checkpoint is compressed-tensors",
    }
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {}
    builtin_draft = None  # vLLM drops the MTP layers here: `layout` skips them itself

    def read_config(self, config: Config) -> dict[str, Any]:
        """The text config brought to the top (read through DeepSeek-V3's attribute map,
        as transformers' DeepseekV3Config reads a `kimi_k2` or `deepseek_v3` text config);
        architectures, model type, quantization and dtype stay the top level's."""
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError(
                "config.json of KimiK25ForConditionalGeneration has no text_config object; "
                "it is not a complete Kimi-K2.5 config"
            )
        text = DeepseekFamily().read_config({**text, "model_type": "deepseek_v3"})
        found = {**config, **text}
        for key in TOP_KEYS:
            if key in config:
                found[key] = config[key]
            elif key == "quantization_config" and key in text:
                found[key] = text[key]
        return found

    def internal_draft(self, config: Config) -> str | None:
        """vLLM serves no MTP draft for Kimi-K2.5 (`SpeculativeConfig.hf_config_override`
        turns only DeepSeek model types into one)."""
        return None

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The text model's, and the vision tower's blocks."""
        layers = VisionDims.of(config).layers
        vision = Count("vision_config.num_hidden_layers", layers, layers)
        return [*super().counts(config, ctx), vision]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        text = super().expected_shapes(config, ctx)
        vision = {name: shape for name, (shape, _) in VisionDims.of(config).tensors().items()}
        return {TEXT + name: shape for name, shape in text.items()} | vision

    def source_dtypes(self, config: Config) -> dict[str, str]:
        return {TEXT + name: dtype for name, dtype in super().source_dtypes(config).items()}

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """The text model's (the vision tower and projector are never quantized)."""
        text = super().quantized_weights(config, shapes)
        return {TEXT + weight: TEXT + layer for weight, layer in text.items()}

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        problems = super().check(config, tp, ctx) + vision_config_problems(config)
        return problems + VisionDims.of(config).problems(tp)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        text_shapes = {n.removeprefix(TEXT): s for n, s in shapes.items() if n.startswith(TEXT)}
        text = super().layout(config, text_shapes, topology, ctx)
        params = [
            dataclasses.replace(
                param,
                name=TEXT + param.name,
                pieces=tuple(p._replace(source=TEXT + p.source) for p in param.pieces),
            )
            for param in text.params
        ]
        stages = tuple(range(topology.pp))
        params += VisionDims.of(config).params(topology.tp, stages)
        # The text model skips only MTP layers, which vLLM drops here: it has no MTP draft.
        mtp = super().builtin_draft_tensors(config, text_shapes)
        skipped = {TEXT + name: NO_MTP for name in mtp}
        return dataclasses.replace(text, params=tuple(params), skipped=skipped)
