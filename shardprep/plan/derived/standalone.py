"""Drafts given with `--draft` beside a target whose layout is derived (EAGLE, EAGLE3,
DFlash, DSpark): vLLM builds the draft of `--speculative-config '{"method": M, "model":
DRAFT, ...}'` on each rank of the last stage and runs its own `load_weights` on
placeholders of the draft checkpoint's tensors (probe.py, draft_probe.py); what its
proposers replace with the target's is the draft's `shared_with_target`.

What the layout cannot say is what a method's `load_weights` does besides copying (the
flags an EAGLE-style draft sets for each tensor it holds, DFlash's fused KV buffers), how
a method's checkpoint is recognized and which side files it reads: each method's own
draft family says that, whatever the target (`archs.draft_family(method, ANY_TARGET)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    DraftFamily,
    Layout,
    PlanContext,
    Shapes,
)
from shardprep.plan.derived import DERIVED, data_parallel_problems, derived_layout
from shardprep.plan.derived.drafts import Speculative
from shardprep.plan.records import FilePlan, ModelPlan, SourceModel
from shardprep.plan.topology import Topology


class DerivedDraft(DraftFamily):
    """A `--draft` draft of a derived target: its layout derived from vLLM."""

    name = DERIVED  # one layout revision for what is derived, the draft included
    method: ClassVar[str]

    def _method_family(self) -> DraftFamily:
        from shardprep.plan import archs

        return archs.draft_family(self.method, archs.ANY_TARGET)

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        """Nothing implied by shardprep: vLLM's loader says which tensor is missing."""
        return {}

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        names = set(ctx.draft_names or ())
        side = sorted(set(self._method_family().side_tensor_files(config)) & names)
        problems = data_parallel_problems(ctx)
        if side:
            problems.append(
                f"its {', '.join(side)} comes from a side file that vLLM reads beside the "
                "checkpoint, which a derived draft layout does not follow yet; convert the "
                "draft without that file (vLLM then embeds the mask token as any other)"
            )
        return problems

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        spec = Speculative.of(self.method, config)
        return derived_layout(ctx.target_config, shapes, topology, self.method, ctx.dtypes, spec)

    def rank_file_problems(
        self, source: SourceModel, model: ModelPlan, files: Sequence[FilePlan], topology: Topology
    ) -> list[str]:
        if model.experts is None or not model.experts.split.uses_ep:
            return []
        return [
            "a derived draft's experts under expert parallelism are not checked against "
            "vLLM's load yet; leave --enable-expert-parallel out"
        ]

    # -- what the method's own draft family says ----------------------------------------

    def recognizes(self, config: Config, names: list[str]) -> bool:
        return self._method_family().recognizes(config, names)

    def side_tensor_files(self, config: Config) -> dict[str, str]:
        return self._method_family().side_tensor_files(config)

    def side_tensor(self, name: str, state: Any, config: Config, where: str) -> Any:
        return self._method_family().side_tensor(name, state, config, where)

    def example_tables(self, config: Config, *, target_config: Config, seed: int) -> dict:
        return self._method_family().example_tables(config, target_config=target_config, seed=seed)

    def before_fill(self, model: Any, names: set[str]) -> None:
        self._method_family().before_fill(model, names)

    def after_fill(self, model: Any, filled: set[str]) -> None:
        self._method_family().after_fill(model, filled)

    @property  # the method's, read on an instance as a class's
    def may_stay_unloaded(self) -> frozenset[str]:  # type: ignore[override]
        return self._method_family().may_stay_unloaded


class DerivedEagleDraft(DerivedDraft):
    method = "eagle"


class DerivedEagle3Draft(DerivedDraft):
    method = "eagle3"


class DerivedDFlashDraft(DerivedDraft):
    method = "dflash"


class DerivedDSparkDraft(DerivedDraft):
    method = "dspark"
