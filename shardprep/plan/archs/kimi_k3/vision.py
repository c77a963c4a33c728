"""Kimi-K3's vision tower (vLLM's `MoonViT3dPretrainedModel` built from a
`KimiK3VisionConfig`) and its `patchmergerv2` projector.

vLLM builds both on every pipeline stage, in the model's dtype, never quantized, and
splits the tower by tp when tp divides its heads (`is_vit_use_data_parallel`; otherwise
it replicates all of it):

- each block's `wqkv` [3 x qkv_hidden, hidden] is a QKVParallelLinear given the fused
  tensor: the rank's rows of q, then of k, then of v; `wo` [hidden, qkv_hidden] by
  columns; `mlp.fc0` by rows, `mlp.fc1` by columns; biases where the config asks for them
  (`attn_bias`, `linear_bias`; K3's defaults have none); the RMS norms `norm0`, `norm1`
  and `encoder.final_layernorm` whole; `patch_embed.proj` (4-D conv weight) and
  `patch_embed.pos_emb` whole;
- the projector: `mm_projector.proj.0/2` load as vLLM's `linear_1/2` (ReplicatedLinear,
  no bias), `mm_projector.post_norm` [text hidden] whole.

The config keys are KimiK3VisionConfig's (`vt_hidden_size`, `vt_num_attention_heads`,
`qkv_hidden_size`, ...), with that class's defaults where a key is absent, as vLLM
builds the tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardprep.plan.archs.base import Config, Param
from shardprep.plan.archs.parts.moonvit import BLOCKS, PROJECTOR, VISION, tower_params
from shardprep.plan.cuts import Cut

# KimiK3VisionConfig's defaults (what vLLM builds when a key is absent).
DEFAULTS: Mapping[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "merge_kernel_size": (2, 2),
    "mm_projector_type": "patchmergerv2",
    "qkv_hidden_size": 1536,
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "linear_bias": False,
    "pos_emb_type": "divided_fixed",
}
SUPPORTED = {
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",
    "pos_emb_type": "divided_fixed",
}


@dataclass(frozen=True)
class VisionTower:
    """The vision tower's sizes and options as vLLM builds them."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    qkv_hidden: int
    patch: int
    pos: tuple[int, int]
    merge: tuple[int, int]
    attn_bias: bool
    linear_bias: bool
    patch_bias: bool
    text_hidden: int
    options: Mapping[str, Any]

    @classmethod
    def of(cls, config: Config) -> VisionTower:
        v = dict(DEFAULTS) | dict(config.get("vision_config") or {})
        text = config.get("text_config")
        text_hidden = (text if isinstance(text, Mapping) else config).get("hidden_size")
        merge = tuple(int(k) for k in v["merge_kernel_size"])
        return cls(
            hidden=int(v["vt_hidden_size"]),
            layers=int(v["vt_num_hidden_layers"]),
            heads=int(v["vt_num_attention_heads"]),
            intermediate=int(v["vt_intermediate_size"]),
            qkv_hidden=int(v.get("qkv_hidden_size") or v["vt_hidden_size"]),
            patch=int(v["patch_size"]),
            pos=(int(v["init_pos_emb_height"]), int(v["init_pos_emb_width"])),
            merge=(merge[0], merge[1]),
            attn_bias=bool(v["attn_bias"]),
            linear_bias=bool(v["linear_bias"]),
            patch_bias=bool(v["patch_embed_proj_bias"]),
            text_hidden=int(text_hidden or 0),
            options={key: v.get(key) for key in SUPPORTED},
        )

    def split(self, tp: int) -> bool:
        """Whether vLLM splits the tower by tp (`is_vit_use_data_parallel`)."""
        return self.heads % tp == 0

    def tensors(self) -> dict[str, tuple[tuple[int, ...], Cut]]:
        """{name: (shape, cut when the tower is split)} of the tower and the projector."""
        h, q, inter = self.hidden, self.qkv_hidden, self.intermediate
        merged = h * self.merge[0] * self.merge[1]
        found: dict[str, tuple[tuple[int, ...], Cut]] = {
            VISION + "patch_embed.proj.weight": ((h, 3, self.patch, self.patch), Cut.REPLICATE),
            VISION + "patch_embed.pos_emb.weight": ((*self.pos, h), Cut.REPLICATE),
            VISION + "encoder.final_layernorm.weight": ((h,), Cut.REPLICATE),
            PROJECTOR + "proj.0.weight": ((merged, merged), Cut.REPLICATE),
            PROJECTOR + "proj.2.weight": ((self.text_hidden, merged), Cut.REPLICATE),
            PROJECTOR + "post_norm.weight": ((self.text_hidden,), Cut.REPLICATE),
        }
        if self.patch_bias:
            found[VISION + "patch_embed.proj.bias"] = ((h,), Cut.REPLICATE)
        for i in range(self.layers):
            block = f"{BLOCKS}{i}."
            found |= {
                block + "wqkv.weight": ((3 * q, h), Cut.PARTS_ROWS),
                block + "wo.weight": ((h, q), Cut.COLS),
                block + "mlp.fc0.weight": ((inter, h), Cut.ROWS),
                block + "mlp.fc1.weight": ((h, inter), Cut.COLS),
                block + "norm0.weight": ((h,), Cut.REPLICATE),
                block + "norm1.weight": ((h,), Cut.REPLICATE),
            }
            if self.attn_bias:
                found[block + "wqkv.bias"] = ((3 * q,), Cut.PARTS_ROWS)
                found[block + "wo.bias"] = ((h,), Cut.REPLICATE)
            if self.linear_bias:
                found[block + "mlp.fc0.bias"] = ((inter,), Cut.ROWS)
                found[block + "mlp.fc1.bias"] = ((h,), Cut.REPLICATE)
        return found

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self.tensors().items()}

    def params(self, tp: int, stages: tuple[int, ...]) -> list[Param]:
        return tower_params(self.tensors(), self.split(tp), stages)

    def problems(self, tp: int) -> list[str]:
        problems = [
            f"vision_config has {key}: {self.options[key]!r}; shardprep places Kimi-K3's "
            f"vision tower with {key} {supported!r} only"
            for key, supported in SUPPORTED.items()
            if self.options[key] != supported
        ]
        if self.qkv_hidden % self.heads:
            problems.append(
                f"vision_config's qkv_hidden_size ({self.qkv_hidden}) is not divisible by "
                f"vt_num_attention_heads ({self.heads}); fix config.json"
            )
        if self.split(tp) and self.intermediate % tp:
            problems.append(
                f"the vision tower's vt_intermediate_size ({self.intermediate}) is not "
                f"divisible by tp={tp}; choose a tp that divides it"
            )
        return problems
