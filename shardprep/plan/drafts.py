"""The planner's rules for a target and its draft, which each family declares and none
re-implements: which drafts a target accepts (`Family.accepted_drafts`), the tensors of
the draft a target checkpoint carries, which the target leaves to it
(`Family.builtin_draft`), and the embedding vLLM also builds on the target's last stage
for a draft that shares it at pp > 1 (`DraftFamily.shares_target_embedding`,
`Family.draft_embedding`)."""

from __future__ import annotations

import dataclasses

from shardprep.plan.archs.base import Config, Family, Layout, Param, PlanContext, Shapes
from shardprep.plan.topology import Topology


def accepted_draft_problems(family: Family, method: str | None) -> list[str]:
    """A draft of a method the target family does not accept, refused in one line."""
    accepted = family.accepted_drafts
    if method is None or accepted is None or method in accepted:
        return []
    verb = "are" if len(accepted) > 1 else "is"
    return [
        f"a draft of method {method!r} for {family.label or family.name} is not supported: "
        f"only {' and '.join(accepted.values())} {verb}; convert the target without --draft"
    ]


def with_target_rules(
    family: Family,
    config: Config,
    shapes: Shapes,
    topology: Topology,
    layout: Layout,
    ctx: PlanContext,
) -> Layout:
    """A target's layout with the draft rules applied: its built-in draft's tensors
    skipped, and its embedding on the last stage too for a draft that shares it (a
    draft's layout comes back as it is: no draft family declares either)."""
    layout = _with_builtin_draft(family, config, shapes, layout, ctx)
    return _with_draft_embedding(family, topology, layout, ctx)


def _with_builtin_draft(
    family: Family, config: Config, shapes: Shapes, layout: Layout, ctx: PlanContext
) -> Layout:
    builtin = family.builtin_draft
    if builtin is None:
        return layout
    why = builtin.held if ctx.draft_method == builtin.method else builtin.left_out
    consumed = {piece.source for param in layout.params for piece in param.pieces}
    names = family.builtin_draft_tensors(config, shapes)
    skipped = {name: why for name in names if name not in consumed}
    # A draft's tensor is skipped for the draft's reason, whatever else the family says.
    return dataclasses.replace(layout, skipped={**layout.skipped, **skipped})


def _with_draft_embedding(
    family: Family, topology: Topology, layout: Layout, ctx: PlanContext
) -> Layout:
    name, last = family.draft_embedding, topology.last_stage
    if not (name and ctx.draft_shares_embedding and topology.pp > 1):
        return layout
    params: list[Param] = []
    added: set[tuple[str, int]] = set()
    for param in layout.params:
        if param.name == name and last not in param.stages:
            param = dataclasses.replace(param, stages=(*param.stages, last))
            added.add((name, last))
        params.append(param)
    spec_only = layout.spec_decode_only | added
    return dataclasses.replace(layout, params=tuple(params), spec_decode_only=spec_only)
