"""The skeleton of EAGLE-style drafts (EAGLE, EAGLE3, DFlash, DSpark): Llama layers named
`model.layers.{i}`, everything on the last stage, the sizes the target's config lends.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    DraftFamily,
    Layout,
    Param,
    PlanContext,
    Shapes,
)
from shardprep.plan.archs.parts.dense import Dims, dense_layers, layer_params
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology


def draft_dims(config: Config, target: Config) -> Dims:
    merged = {**target, **{k: v for k, v in config.items() if v is not None}}
    return Dims(merged)


class EagleBase(DraftFamily):
    """What EAGLE and EAGLE3 drafts share: layers named `model.layers.{i}` (vLLM renames
    only the attention prefix after the target's layers), everything on the last stage,
    embedding and lm_head optional (vLLM shares the target's when absent)."""

    layer_pattern: ClassVar[re.Pattern[str]]
    top_level: ClassVar[dict[str, tuple[str, Cut]]]
    skipped_names: ClassVar[dict[str, str]] = {}
    optional_sources: ClassVar[frozenset[str]] = frozenset({"embed_tokens.weight"})
    # Index tables vLLM holds as integers (draft-to-target token ids: torch.long).
    integer_tables: ClassVar[dict[str, str]] = {"d2t": "I64"}
    # At pp > 1 vLLM builds the target's embedding on the last stage too, for the draft to
    # share when it holds none of its own.
    shares_target_embedding = True

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        return draft_dims(config, ctx.target_config).check(tp)

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        dims = draft_dims(config, ctx.target_config)
        last = topology.last_stage
        skipped = {n: r for n, r in self.skipped_names.items() if n in shapes}
        kept = [name for name in shapes if name not in skipped]
        params: list[Param] = []
        for index, names in sorted(dense_layers(kept, self.layer_pattern).items()):
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
