"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and its MTP draft: DeepSeek-V3 plus the
lightning indexer of DeepSeek Sparse Attention in every attention layer.

vLLM reads the config through `DeepseekV3Config` and builds the decoder layers as
DeepSeek-V3's (`deepseek_v2.py` on CPU and XPU, `models/deepseek_v32/` on CUDA and ROCm,
with the same parameters), each attention layer with an indexer under
`self_attn.indexer.` that is never split by tensor parallelism:

- `wq_b` [index_n_heads x index_head_dim, q_lora_rank]: a `ReplicatedLinear` with the
  model's quantization (fp8 blocks in the published checkpoint);
- `wk` [index_head_dim, hidden] and `weights_proj` [index_n_heads, hidden]: fused, in that
  order, into one replicated `wk_weights_proj` built without quantization. The published
  fp8 checkpoint stores `wk` fp8 with block scales, which vLLM dequantizes into it while
  loading (`_try_load_fp8_indexer_wk`): a computation, not a copy, which shardprep does not
  do yet, so such a checkpoint is refused with that reason;
- `k_norm` (a LayerNorm, weight and bias): float32 whatever the model's dtype.

With `index_topk_freq` > 1 or an `index_topk_pattern`, layers that reuse the previous
layer's top-k build no indexer, and vLLM drops their checkpoint weights; MTP layers
always build one. The MTP layers are the draft `mtp` (vLLM's `DeepseekV32MTPModel`), laid
out as DeepSeek-V3's (`deepseek_mtp.py`) with the indexer in `mtp_block`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.errors import ConfigError, PlanError, summarize
from shardprep.plan.archs.base import Config, Layout, Shapes, config_int
from shardprep.plan.archs.deepseek import F32, LAYER, DeepseekFamily, Dims
from shardprep.plan.archs.deepseek_mtp import DeepseekMtpDraft
from shardprep.plan.layout import Cut, Piece
from shardprep.plan.topology import Topology

INDEXER = "self_attn.indexer."
FUSED_WK = INDEXER + "wk_weights_proj.weight"


@dataclass(frozen=True)
class V32Dims(Dims):
    """DeepSeek-V3's sizes and the indexer's."""

    index_heads: int = 0
    index_head_dim: int = 0
    # vLLM's IndexCache rule (`DeepseekV2MLAAttention`): which layers skip the top-k.
    topk_freq: int = 1
    topk_pattern: tuple[str, ...] | None = None  # one letter per layer, "S": skip
    skip_offset: int = 2

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
        return {
            INDEXER + "wq_b.weight": ((heads * dim, self.q_lora), None),
            INDEXER + "wk.weight": ((dim, self.hidden), None),
            INDEXER + "weights_proj.weight": ((heads, self.hidden), None),
            INDEXER + "k_norm.weight": ((dim,), F32),
            INDEXER + "k_norm.bias": ((dim,), F32),
        }


class DeepseekV32Family(DeepseekFamily):
    name = "deepseek_v32"
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

    def internal_draft(self, config: Config) -> str | None:
        """vLLM serves a deepseek_v32 checkpoint's MTP layers as the `mtp` draft."""
        return "mtp" if config.get("num_nextn_predict_layers") else None

    def check(self, config: Config, tp: int, **context: Any) -> list[str]:
        problems = []
        if config.get("index_topk") is None:
            problems.append(
                "config.json has no index_topk, so vLLM would build this DeepseekV32ForCausalLM "
                "without its indexer; fix config.json"
            )
        return problems + super().check(config, tp, **context)

    def layout(self, config: Config, shapes: Shapes, topology: Topology, **context: Any) -> Layout:
        base = super().layout(config, shapes, topology, **context)
        return with_unbuilt_indexers(self.dims(config), base, shapes)


def with_unbuilt_indexers(d: V32Dims, layout: Layout, shapes: Shapes) -> Layout:
    """`layout` with the indexer tensors of layers that build no indexer skipped; a
    checkpoint whose indexer `wk` is stored quantized is refused."""
    scaled = sorted(
        name.removesuffix("_scale_inv")
        for name in shapes
        if name.endswith(INDEXER + "wk.weight_scale_inv")
        and d.has_indexer(int(LAYER.match(name)[1]))  # type: ignore[index]
    )
    if scaled:
        raise PlanError(
            f"the indexer's wk is stored fp8 with block scales ({summarize(scaled)}): vLLM "
            "dequantizes it into the bfloat16 wk_weights_proj while loading, a computation "
            "shardprep does not do yet; convert a checkpoint whose indexer wk is bfloat16"
        )
    skipped = dict(layout.skipped)
    for name in shapes:
        match = LAYER.match(name)
        if match and match[2].startswith(INDEXER) and not d.has_indexer(int(match[1])):
            skipped.setdefault(
                name, "the indexer of a layer that reuses the previous layer's top-k, which "
                "vLLM does not build (index_topk_freq, index_topk_pattern)"
            )  # fmt: skip
    return dataclasses.replace(layout, skipped=skipped)


class DeepseekV32MtpDraft(DeepseekMtpDraft):
    name = "deepseek_v32_mtp"
    target = DeepseekV32Family
    attribute_maps = DeepseekV32Family.attribute_maps
