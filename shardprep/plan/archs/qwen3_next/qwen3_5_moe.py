"""Qwen3.5-MoE and Qwen3.6-MoE (`Qwen3_5MoeForConditionalGeneration`, vLLM's `qwen3_5.py`,
`qwen3_5_mtp.py` and the Qwen3-VL vision tower of `qwen3_vl.py`) and their MTP draft.

The text model is Qwen3-Next's (`Qwen3NextFamily`'s rules) as published: under
`model.language_model.` (vLLM: `language_model.model.`, `lm_head` as
`language_model.lm_head`), config.json holding it under `text_config`. What differs:

- every layer holds experts (`Qwen3_5DecoderLayer` for `qwen3_5_moe_text`), stored as
  transformers 5 keeps them, one stack per layer: `mlp.experts.gate_up_proj` [E, 2I, H]
  (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I];
  FusedMoE's loader (`RoutedExperts.load_weights`, fused branch) takes each expert's
  gate half and up half apart (`chunk(2, dim=1)`), then the rank's rows of each, and the
  rank's columns of down_proj;
- a DeltaNet's input projections come apart, `in_proj_qkv` [2K + V, H], `in_proj_z` [V, H],
  `in_proj_b` and `in_proj_a` [V heads, H], and vLLM fuses them without Qwen3-Next's per
  key head grouping (`gqa_interleaved_layout=False`): `in_proj_qkvz` is a
  MergedColumnParallelLinear of outputs [K, K, V, V] loaded with shard ids (0, 1, 2) from
  `in_proj_qkv` and 3 from `in_proj_z` (`Qwen3_5Model.hf_to_vllm_mapper`), so a rank holds
  its q rows, k rows, v rows, then its z rows; `in_proj_ba` [V heads, V heads] holds its
  b rows, then its a rows;
- lm_head is built on the last stage only (the embedding on every stage, as for
  Qwen3-Next);
- the MTP draft is `mtp.*` as for Qwen3-Next (`Qwen3_5MTP.load_weights`: `mtp.` becomes
  `model.`), its embedding read from `model.language_model.embed_tokens.weight`;
  `mtp_num_hidden_layers` says how many layers it has.

The vision tower (`model.visual.`, vLLM's `visual.`) is built and loaded on every pipeline
stage, TP-sharded (`mm_encoder_tp_mode` "weights", the default): each block's fused
`attn.qkv` (and bias) gives the rank's rows of q, k and v (QKVParallelLinear), `attn.proj`
by columns (bias whole), `mlp.linear_fc1` by rows (and bias), `mlp.linear_fc2` by columns
(bias whole), norms, `patch_embed.proj` and `pos_embed` whole; the mergers
(`merger`, `deepstack_merger_list.N`): `linear_fc1` by rows, `linear_fc2` by columns.
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
from shardprep.plan.archs.qwen3_next.family import (
    ROUTED,
    NextDims,
    Qwen3NextFamily,
)
from shardprep.plan.archs.qwen3_next.mtp import Qwen3NextMtpDraft
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

TEXT = "model.language_model."  # published; Qwen3-Next's `model.`
VLLM_TEXT = "language_model.model."
HEAD = "lm_head.weight"
VLLM_HEAD = "language_model.lm_head.weight"
VISUAL = "model.visual."
VLLM_VISUAL = "visual."
LINEAR = "linear_attn."
# The config keys that stay the top level's when the text config is brought up.
TOP_KEYS = ("architectures", "model_type", "quantization_config", "torch_dtype", "dtype")
# transformers' Qwen3_5MoeVisionConfig defaults (what vLLM builds when a key is absent).
VISION_DEFAULTS: Mapping[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [],
}


class Qwen35Dims(NextDims):
    """Qwen3-Next's sizes, with Qwen3.5-MoE's projections, experts and MTP count."""

    label = "Qwen3.5-MoE"
    mtp_key = "mtp_num_hidden_layers"

    def __init__(self, config: Config) -> None:
        # No layer has a dense MLP, and config.json no `intermediate_size`: Dims reads one.
        super().__init__({"intermediate_size": 1, **config})
        self.mtp = int(config.get("mtp_num_hidden_layers", 1) or 0)
        self.sparse_step, self.mlp_only = 1, set()  # every layer holds experts

    def expert_count(self) -> Count:
        """The routed experts, stacked in each decoder layer's tensors."""
        stacks = tuple(f"{TEXT}layers.{i}.mlp.experts.gate_up_proj" for i in range(self.layers))
        return Count("num_experts", self.experts, stacks=stacks)

    def projection_shapes(self) -> dict[str, tuple[int, ...]]:
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        return {
            LINEAR + "in_proj_qkv.weight": (2 * key + value, self.hidden),
            LINEAR + "in_proj_z.weight": (value, self.hidden),
            LINEAR + "in_proj_b.weight": (self.v_heads, self.hidden),
            LINEAR + "in_proj_a.weight": (self.v_heads, self.hidden),
        }

    def projection_params(self, hf_prefix: str, vllm_prefix: str, stage: int) -> list[Param]:
        """`in_proj_qkvz`: the rank's q, k and v rows of `in_proj_qkv`, then its z rows;
        `in_proj_ba`: its b rows, then its a rows."""
        src = hf_prefix + LINEAR
        qkvz = (
            Piece(src + "in_proj_qkv.weight", Cut.QKV_ROWS, heads=self.k_heads * self.k_dim),
            Piece(src + "in_proj_z.weight", Cut.ROWS),
        )
        ba = (Piece(src + "in_proj_b.weight", Cut.ROWS), Piece(src + "in_proj_a.weight", Cut.ROWS))
        return [
            Param(vllm_prefix + LINEAR + "in_proj_qkvz.weight", qkvz, (stage,)),
            Param(vllm_prefix + LINEAR + "in_proj_ba.weight", ba, (stage,)),
        ]

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        e, inter, h = self.experts, self.moe_intermediate, self.hidden
        return {
            "mlp.experts.gate_up_proj": (e, 2 * inter, h),
            "mlp.experts.down_proj": (e, h, inter),
        }

    def expert_stack_params(self, hf_prefix: str, vllm_prefix: str, stage: int) -> list[Param]:
        gate_up, down = f"{hf_prefix}mlp.experts.gate_up_proj", f"{hf_prefix}mlp.experts.down_proj"
        experts = range(self.experts)
        w13 = tuple(Piece(gate_up, Cut.EXPERT_HALVES_ROWS, expert=e) for e in experts)
        w2 = tuple(Piece(down, Cut.EXPERT_COLS, expert=e) for e in experts)
        return [
            Param(f"{vllm_prefix}{ROUTED}w13_weight", w13, (stage,)),
            Param(f"{vllm_prefix}{ROUTED}w2_weight", w2, (stage,)),
        ]


@dataclass(frozen=True)
class VisionDims:
    """The Qwen3-VL vision tower's sizes as vLLM builds it (`Qwen3_VisionTransformer`)."""

    hidden: int
    depth: int
    heads: int
    intermediate: int
    channels: int
    patch: int
    temporal: int
    merge: int
    out: int
    positions: int
    deepstack: int

    @classmethod
    def of(cls, config: Config) -> VisionDims:
        v = dict(VISION_DEFAULTS) | dict(config.get("vision_config") or {})
        return cls(
            hidden=int(v["hidden_size"]),
            depth=int(v["depth"]),
            heads=int(v["num_heads"]),
            intermediate=int(v["intermediate_size"]),
            channels=int(v["in_channels"]),
            patch=int(v["patch_size"]),
            temporal=int(v["temporal_patch_size"]),
            merge=int(v["spatial_merge_size"]),
            out=int(v["out_hidden_size"]),
            positions=int(v["num_position_embeddings"]),
            deepstack=len(v["deepstack_visual_indexes"] or ()),
        )

    def tensors(self) -> dict[str, tuple[tuple[int, ...], Cut]]:
        """{published name: (shape, cut)} of the tower and its mergers."""
        h, inter, merged = self.hidden, self.intermediate, self.hidden * self.merge**2
        found: dict[str, tuple[tuple[int, ...], Cut]] = {
            "patch_embed.proj.weight": (
                (h, self.channels, self.temporal, self.patch, self.patch),
                Cut.REPLICATE,
            ),
            "patch_embed.proj.bias": ((h,), Cut.REPLICATE),
            "pos_embed.weight": ((self.positions, h), Cut.REPLICATE),
        }
        for i in range(self.depth):
            block = f"blocks.{i}."
            found |= {
                block + "attn.qkv.weight": ((3 * h, h), Cut.PARTS_ROWS),
                block + "attn.qkv.bias": ((3 * h,), Cut.PARTS_ROWS),
                block + "attn.proj.weight": ((h, h), Cut.COLS),
                block + "attn.proj.bias": ((h,), Cut.REPLICATE),
                block + "mlp.linear_fc1.weight": ((inter, h), Cut.ROWS),
                block + "mlp.linear_fc1.bias": ((inter,), Cut.ROWS),
                block + "mlp.linear_fc2.weight": ((h, inter), Cut.COLS),
                block + "mlp.linear_fc2.bias": ((h,), Cut.REPLICATE),
            }
            for norm in ("norm1", "norm2"):
                found |= {block + f"{norm}.{p}": ((h,), Cut.REPLICATE) for p in ("weight", "bias")}
        mergers = {"merger.": h} | {
            f"deepstack_merger_list.{j}.": merged for j in range(self.deepstack)
        }
        for merger, width in mergers.items():
            found |= {
                merger + "norm.weight": ((width,), Cut.REPLICATE),
                merger + "norm.bias": ((width,), Cut.REPLICATE),
                merger + "linear_fc1.weight": ((merged, merged), Cut.ROWS),
                merger + "linear_fc1.bias": ((merged,), Cut.ROWS),
                merger + "linear_fc2.weight": ((self.out, merged), Cut.COLS),
                merger + "linear_fc2.bias": ((self.out,), Cut.REPLICATE),
            }
        return {VISUAL + name: entry for name, entry in found.items()}

    def params(self, stages: tuple[int, ...]) -> list[Param]:
        return [
            Param(
                VLLM_VISUAL + name.removeprefix(VISUAL),
                (Piece(name, cut, 3 if cut is Cut.PARTS_ROWS else 0),),
                stages,
            )
            for name, (_, cut) in self.tensors().items()
        ]

    def problems(self, tp: int) -> list[str]:
        sizes = {
            "num_heads": self.heads,
            "intermediate_size": self.intermediate,
            "hidden_size x spatial_merge_size^2": self.hidden * self.merge**2,
        }
        return [
            f"the vision tower's {key} ({size}) is not divisible by tp={tp}; vLLM splits the "
            "tower by tp: choose a tp that divides it"
            for key, size in sizes.items()
            if size % tp
        ]


def read_text_config(config: Config) -> dict[str, Any]:
    """The text config brought to the top, as vLLM's `hf_text_config` reads it;
    architectures, model type, quantization and dtype stay the top level's."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(
            "config.json of Qwen3_5MoeForConditionalGeneration has no text_config object; "
            "it is not a complete Qwen3.5-MoE config"
        )
    found = {**config, **text}
    for key in TOP_KEYS:
        if key in config:
            found[key] = config[key]
    return found


def _to_vllm(name: str) -> str:
    """A text parameter's name in Qwen3-Next's naming, as vLLM names it here."""
    return VLLM_HEAD if name == HEAD else VLLM_TEXT + name.removeprefix("model.")


def _to_published(name: str) -> str:
    return name if name == HEAD else TEXT + name.removeprefix("model.")


class Qwen35MoeFamily(Qwen3NextFamily):
    name = "qwen3_5_moe"
    dims: ClassVar[type[NextDims]] = Qwen35Dims
    # Qwen3-Next's fp8 layout under the published names is not proven against vLLM here.
    quant_schemes: ClassVar[frozenset[str]] = frozenset()
    quant_refusals: ClassVar[Mapping[str, str]] = {}

    def read_config(self, config: Config) -> dict[str, Any]:
        return read_text_config(config)

    def internal_draft(self, config: Config) -> str | None:
        """The `mtp` draft when `mtp_num_hidden_layers` (vLLM's default: 1) is not 0; the
        config as published or already read."""
        return super().internal_draft(
            read_text_config(config) if "text_config" in config else config
        )

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The text model's, and the vision tower's blocks."""
        depth = VisionDims.of(config).depth
        return [*super().counts(config, ctx), Count("vision_config.depth", depth, depth)]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        text = super().expected_shapes(config, ctx)
        vision = {name: shape for name, (shape, _) in VisionDims.of(config).tensors().items()}
        return {_to_published(name): shape for name, shape in text.items()} | vision

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        problems = super().check(config, tp, ctx) + VisionDims.of(config).problems(tp)
        if config.get("layer_scale"):
            problems.append(
                "layer_scale is true: vLLM then gives each layer scales that shardprep does "
                "not place for Qwen3.5-MoE; convert a checkpoint without layer_scale"
            )
        return problems

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        text_shapes = {
            ("model." + n.removeprefix(TEXT)) if n.startswith(TEXT) else n: s
            for n, s in shapes.items()
            if not n.startswith(VISUAL)
        }
        text = super().layout(config, text_shapes, topology, ctx)
        params = [
            dataclasses.replace(
                param,
                name=_to_vllm(param.name),
                pieces=tuple(p._replace(source=_to_published(p.source)) for p in param.pieces),
                # `Qwen3_5ForCausalLMBase` builds lm_head on the last stage only.
                stages=(topology.last_stage,) if param.name == HEAD else param.stages,
            )
            for param in text.params
        ]
        params += VisionDims.of(config).params(tuple(range(topology.pp)))
        return dataclasses.replace(text, params=tuple(params))


class Qwen35MoeMtpDraft(Qwen3NextMtpDraft):
    name = "qwen3_5_moe_mtp"
    dims: ClassVar[type[NextDims]] = Qwen35Dims
    quant_schemes = Qwen35MoeFamily.quant_schemes
    quant_refusals = Qwen35MoeFamily.quant_refusals
    embed_source = TEXT + "embed_tokens.weight"
