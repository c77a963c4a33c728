"""The planner's rules of a target and its draft (plan/drafts.py), which families declare:
the drafts a target accepts, the tensors of the draft inside a target checkpoint, and the
embedding vLLM builds on the last stage for a draft that shares it."""

from __future__ import annotations

from typing import ClassVar

import pytest

from shardprep.format.records import Topology
from shardprep.plan import archs
from shardprep.plan.archs.base import (
    BuiltinDraft,
    Config,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
)
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.drafts import accepted_draft_problems, with_target_rules

EMBED = "model.embed_tokens.weight"


class Declaring(Family):
    """A made-up target that declares every draft rule."""

    name = "declaring"
    label = "Declaring"
    builtin_draft = BuiltinDraft("mtp", held="held by the draft", left_out="left out")
    accepted_drafts: ClassVar[dict[str, str]] = {"mtp": "its MTP draft"}
    draft_embedding = EMBED

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        return [name for name in shapes if name.startswith("mtp.")]


def layout(*params: Param) -> Layout:
    return Layout(params, skipped={"rotary.inv_freq": "computed by vLLM"})


def embed(*stages: int) -> Param:
    return Param(EMBED, (Piece(EMBED, Cut.VOCAB),), stages)


SHAPES = {EMBED: (8, 4), "mtp.0.norm.weight": (4,), "rotary.inv_freq": (2,)}


@pytest.mark.parametrize("method", ["mtp", None, "eagle3"])
def test_the_builtin_draft_tensors_are_skipped_for_the_reason_that_fits(method: str | None) -> None:
    ctx = PlanContext(pp=2, draft_method=method)
    found = with_target_rules(Declaring(), {}, SHAPES, Topology(1, 2, (1, 1)), layout(), ctx)
    why = "held by the draft" if method == "mtp" else "left out"
    assert found.skipped == {"rotary.inv_freq": "computed by vLLM", "mtp.0.norm.weight": why}


def test_the_embedding_joins_the_last_stage_only_for_a_draft_that_shares_it_at_pp2() -> None:
    two = Topology(1, 2, (1, 1))
    shares = PlanContext(pp=2, draft_method="mtp", draft_shares_embedding=True)
    found = with_target_rules(Declaring(), {}, SHAPES, two, layout(embed(0)), shares)
    assert found.params == (embed(0, 1),)
    assert found.spec_decode_only == {(EMBED, 1)}
    own = PlanContext(pp=2, draft_method="mtp")  # a draft with an embedding of its own
    assert with_target_rules(Declaring(), {}, SHAPES, two, layout(embed(0)), own).params == (
        embed(0),
    )
    one = Topology(1, 1, (2,))
    single = with_target_rules(Declaring(), {}, SHAPES, one, layout(embed(0)), shares)
    assert (single.params, single.spec_decode_only) == ((embed(0),), frozenset())
    tied = with_target_rules(Declaring(), {}, SHAPES, two, layout(embed(0, 1)), shares)
    assert (tied.params, tied.spec_decode_only) == ((embed(0, 1),), frozenset())


def test_a_draft_the_target_does_not_accept_is_refused_in_one_line() -> None:
    assert accepted_draft_problems(Declaring(), "mtp") == []
    assert accepted_draft_problems(Declaring(), None) == []
    assert accepted_draft_problems(Declaring(), "eagle3") == [
        "a draft of method 'eagle3' for Declaring is not supported: only its MTP draft is; "
        "convert the target without --draft"
    ]
    assert accepted_draft_problems(archs.target_family_of("LlamaForCausalLM"), "eagle3") == []


def test_every_declared_draft_is_one_the_registry_holds_for_its_target() -> None:
    """A target's built-in draft and the drafts it accepts name draft families that the
    registry gives for it; a built-in draft never comes with --draft."""
    targets = [archs.target_family_of(name) for name in archs.supported()[0]]
    for family in targets:
        if family.builtin_draft is not None:
            draft = archs.draft_family(family.builtin_draft.method, family.name)
            assert not draft.standalone, family.name
        for method in family.accepted_drafts or ():
            assert archs.draft_family(method, family.name), (family.name, method)
    declared = {f.name for f in targets if f.builtin_draft is not None}
    assert declared == {
        "deepseek", "deepseek_v32", "deepseek_v4", "glm4_moe", "kimi_k3", "qwen3_next",
        "qwen3_5_moe",
    }  # fmt: skip
