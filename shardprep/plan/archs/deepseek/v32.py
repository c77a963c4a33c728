"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and its MTP draft: DeepSeek-V3 plus the
lightning indexer of DeepSeek Sparse Attention in every attention layer.

vLLM reads the config through `DeepseekV3Config` and builds the decoder layers as
DeepSeek-V3's (`deepseek_v2.py` on CPU and XPU; `models/deepseek_v32/` on CUDA and ROCm,
whose parameters and `load_weights` rules read the same in vLLM's source, while only the
CPU build's state is proven by the tests), each attention layer with an indexer under
`self_attn.indexer.` that is never split by tensor parallelism:

- `wq_b` [index_n_heads x index_head_dim, q_lora_rank]: a `ReplicatedLinear` with the
  model's quantization (fp8 blocks in the published checkpoint);
- `wk` [index_head_dim, hidden] and `weights_proj` [index_n_heads, hidden]: fused, in that
  order, into one replicated `wk_weights_proj` built without quantization. The published
  fp8 checkpoint stores `wk` fp8 with block scales, which vLLM dequantizes to bfloat16
  before fusing it (`_try_load_fp8_indexer_wk`); convert computes the same bytes
  (`dequantized_sources`, convert/dequantize.py) and the layout reads those;
- `k_norm` (a LayerNorm, weight and bias): float32 whatever the model's dtype.

With `index_topk_freq` > 1 or an `index_topk_pattern`, layers that reuse the previous
layer's top-k build no indexer, and vLLM drops their checkpoint weights; MTP layers
always build one. The MTP layers are the draft `mtp` (vLLM's `DeepseekV32MTPModel`), laid
out as DeepSeek-V3's (`mtp.py`) with the indexer in `mtp_block`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from shardprep.errors import ConfigError, PlanError, summarize
from shardprep.format.dtypes import FLOAT_DTYPES
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    DEQUANTIZED,
    Config,
    Layout,
    PlanContext,
    Shapes,
    config_int,
)
from shardprep.plan.archs.deepseek.mtp import DeepseekMtpDraft
from shardprep.plan.archs.deepseek.v3 import DeepseekFamily
from shardprep.plan.archs.parts.mla import F32, Dims
from shardprep.plan.archs.parts.names import LAYER
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.fp8 import FP8, SCALE_DTYPE, BlockQuant, scale_name
from shardprep.plan.topology import Topology

INDEXER = "self_attn.indexer."
FUSED_WK = INDEXER + "wk_weights_proj.weight"
WK = INDEXER + "wk.weight"


@dataclass(frozen=True)
class V32Dims(Dims):
    """DeepSeek-V3's sizes and the indexer's."""

    index_heads: int = 0
    index_head_dim: int = 0
    # vLLM's IndexCache rule (`DeepseekV2MLAAttention`): which layers skip the top-k.
    topk_freq: int = 1
    topk_pattern: tuple[str, ...] | None = None  # one letter per layer, "S": skip
    skip_offset: int = 2
    # fp8 blocks of an fp8 checkpoint, which stores wk quantized as published
    block: tuple[int, int] | None = None

    @classmethod
    def of(cls, config: Config) -> V32Dims:
        base = {f.name: getattr(Dims.of(config), f.name) for f in dataclasses.fields(Dims)}
        if base["q_lora"] is None:
            raise ConfigError(
                "DeepSeek-V3.2 needs q_lora_rank in config.json: vLLM builds the indexer's "
                "wq_b from the compressed query; fix config.json"
            )
        pattern = config.get("index_topk_pattern")
        return cls(
            **base,
            index_heads=config_int(config, "index_n_heads"),
            index_head_dim=config_int(config, "index_head_dim"),
            topk_freq=config_int(config, "index_topk_freq", 1),
            topk_pattern=tuple(str(p) for p in pattern) if pattern is not None else None,
            skip_offset=int(config.get("index_skip_topk_offset", 2)),
            block=_fp8_block(config),
        )

    def has_indexer(self, layer: int) -> bool:
        """Whether vLLM builds an indexer in this layer (MTP layers always do)."""
        if layer >= self.layers:
            return True
        if self.topk_pattern is None:
            return max(layer - self.skip_offset + 1, 0) % self.topk_freq == 0
        return not (layer < len(self.topk_pattern) and self.topk_pattern[layer] == "S")

    def indexer_sources(self, layer: int) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """{suffix inside the layer: (shape, fixed dtype)} of the indexer's tensors, as
        published: `k_norm` float32, the rest in the model's dtype (or quantized)."""
        assert self.q_lora is not None  # `of` refuses a config without q_lora_rank
        heads, dim = self.index_heads, self.index_head_dim
        found: dict[str, tuple[tuple[int, ...], str | None]] = {
            INDEXER + "wq_b.weight": ((heads * dim, self.q_lora), None),
            WK: ((dim, self.hidden), None),
            INDEXER + "weights_proj.weight": ((heads, self.hidden), None),
            INDEXER + "k_norm.weight": ((dim,), F32),
            INDEXER + "k_norm.bias": ((dim,), F32),
        }
        if self.block is not None:  # wk fp8 with its block scales, as published
            rows, cols = -(-dim // self.block[0]), -(-self.hidden // self.block[1])
            found[WK] = ((dim, self.hidden), FP8)
            found[scale_name(WK)] = ((rows, cols), SCALE_DTYPE)
        return found


class DeepseekV32Family(DeepseekFamily):
    name = "deepseek_v32"
    # Not compressed-tensors fp8: the indexer's `wk` is laid out for fp8 blocks only.
    quant_schemes = frozenset({"fp8_block", "int4_pack", "mxfp4_pack", "nvfp4_pack"})
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "the indexer's wk, which vLLM dequantizes while loading, is read from fp8 blocks only"
    }
    # vLLM reads a deepseek_v32 config with transformers' DeepseekV3Config.
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {
        "deepseek_v32": DeepseekFamily.attribute_maps["deepseek_v3"]
    }

    def dims(self, config: Config) -> V32Dims:
        return V32Dims.of(config)

    def layer_sources(self, d: Dims, layer: int) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """DeepSeek-V3's tensors of a layer and its indexer's, which the checkpoint holds
        in every layer, also those where vLLM builds none."""
        assert isinstance(d, V32Dims)
        prefix = f"model.layers.{layer}."
        found = super().layer_sources(d, layer)
        return found | {prefix + s: v for s, v in d.indexer_sources(layer).items()}

    def layer_quantized(self, d: Dims, layer: int) -> dict[str, str]:
        """DeepSeek-V3's quantized weights and the indexer's `wq_b` (`wk` and
        `weights_proj` are built without quantization)."""
        assert isinstance(d, V32Dims)
        found = super().layer_quantized(d, layer)
        if d.has_indexer(layer):
            wq_b = f"model.layers.{layer}.{INDEXER}wq_b"
            found[wq_b + ".weight"] = wq_b
        return found

    def layer_params(
        self, d: Dims, layer: int, prefix: str
    ) -> Iterator[tuple[str, Piece, str | None]]:
        assert isinstance(d, V32Dims)
        yield from super().layer_params(d, layer, prefix)
        if not d.has_indexer(layer):
            return
        source = f"model.layers.{layer}.{INDEXER}"
        yield prefix + INDEXER + "wq_b.weight", Piece(source + "wq_b.weight", Cut.REPLICATE), None
        for part in ("wk", "weights_proj"):
            yield prefix + FUSED_WK, Piece(f"{source}{part}.weight", Cut.REPLICATE), None
        for norm in ("k_norm.weight", "k_norm.bias"):
            yield prefix + INDEXER + norm, Piece(source + norm, Cut.REPLICATE), F32

    def dequantized_sources(
        self, config: Config, dtypes: Mapping[str, str], shapes: Shapes
    ) -> dict[str, tuple[str, str]]:
        """Each built indexer's `wk` that the checkpoint stores quantized, with its block
        scales: vLLM dequantizes it to bfloat16 before fusing it."""
        d = self.dims(config)
        return {
            name + DEQUANTIZED: (name, scale_name(name))
            for name, dtype in dtypes.items()
            if name.endswith(WK)
            and dtype not in FLOAT_DTYPES
            and scale_name(name) in dtypes
            and (match := LAYER.match(name))
            and d.has_indexer(int(match[1]))
        }

    def internal_draft(self, config: Config) -> str | None:
        """vLLM serves a deepseek_v32 checkpoint's MTP layers as the `mtp` draft."""
        return "mtp" if config.get("num_nextn_predict_layers") else None

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        problems = []
        if config.get("index_topk") is None:
            problems.append(
                "config.json has no index_topk, so vLLM would build this DeepseekV32ForCausalLM "
                "without its indexer; fix config.json"
            )
        return problems + super().check(config, tp, ctx)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        base = super().layout(config, shapes, topology, ctx)
        return with_unbuilt_indexers(self.dims(config), base, shapes)


def with_unbuilt_indexers(d: V32Dims, layout: Layout, shapes: Shapes) -> Layout:
    """`layout` with the indexer tensors of layers that build no indexer skipped, and
    each quantized `wk` read dequantized (see `read_dequantized`)."""
    layout = read_dequantized(layout, shapes)
    skipped = dict(layout.skipped)
    for name in shapes:
        match = LAYER.match(name)
        if match and match[2].startswith(INDEXER) and not d.has_indexer(int(match[1])):
            skipped.setdefault(
                name, "the indexer of a layer that reuses the previous layer's top-k, which "
                "vLLM does not build (index_topk_freq, index_topk_pattern)"
            )  # fmt: skip
    return dataclasses.replace(layout, skipped=skipped)


def read_dequantized(layout: Layout, shapes: Shapes) -> Layout:
    """Each piece of a stored-quantized `wk` read from its dequantized copy, which
    convert adds to the checkpoint's tensors (`DeepseekV32Family.dequantized_sources`),
    the stored weight and its scales skipped; a quantized `wk` without that copy (planned
    from headers alone) is refused. The scales are optional: a checkpoint may store `wk`
    in bfloat16."""
    swap = {name.removesuffix(DEQUANTIZED): name for name in shapes if name.endswith(DEQUANTIZED)}
    params = tuple(
        dataclasses.replace(
            param,
            pieces=tuple(
                piece._replace(source=swap.get(piece.source, piece.source))
                for piece in param.pieces
            ),
        )
        for param in layout.params
    )
    used = {piece.source for param in params for piece in param.pieces}
    scaled = sorted(w for w in used if w.endswith(WK) and scale_name(w) in shapes)
    if scaled:
        raise PlanError(
            f"the indexer's wk is stored fp8 with block scales ({summarize(scaled)}), which "
            "vLLM dequantizes while loading; plan the checkpoint with `shardprep plan` or "
            "`convert`, which dequantize it as vLLM does"
        )
    skipped = {name: why for name, why in layout.skipped.items() if name not in used}
    for weight, dequantized in swap.items():
        if dequantized in used:
            skipped[weight] = (
                "stored fp8: vLLM dequantizes it with its block scales while loading, and "
                f"the rank files hold it dequantized ({dequantized})"
            )
            skipped[scale_name(weight)] = f"the block scales of {weight}, dequantized into it"
    stored = {w.removesuffix(DEQUANTIZED) for w in used}
    optional = {scale_name(w) for w in stored if w.endswith(WK)}
    return dataclasses.replace(
        layout,
        params=params,
        skipped=skipped,
        optional_sources=layout.optional_sources | optional,
    )


def _fp8_block(config: Config) -> tuple[int, int] | None:
    scheme = scheme_of(config)
    return scheme.block if isinstance(scheme, BlockQuant) and not scheme.problem else None


class DeepseekV32MtpDraft(DeepseekMtpDraft):
    name = "deepseek_v32_mtp"
    quant_schemes = DeepseekV32Family.quant_schemes
    quant_refusals = DeepseekV32Family.quant_refusals
    target = DeepseekV32Family
    attribute_maps = DeepseekV32Family.attribute_maps

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        return read_dequantized(super().layout(config, shapes, topology, ctx), shapes)
