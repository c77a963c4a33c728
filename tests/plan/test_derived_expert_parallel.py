"""A derived layout under expert parallelism (plan/derived/expert_parallel.py): the rank
files the planner makes of it, whole experts per rank, are checked against what vLLM's
own `load_weights` does on each rank with expert parallelism on. For the families
shardprep writes by hand they come out equal to the hand-written plan, file for file; a
plan whose experts are placed otherwise than vLLM's is refused naming the parameter."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from shardprep.demo.tiny import tiny_config
from shardprep.errors import PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.derived import DerivedFamily, available
from shardprep.plan.derived.expert_parallel import rank_file_problems
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel

needs_vllm = pytest.mark.skipif(not available(), reason="deriving needs vLLM installed")

CASES = {
    # name: (architecture, tp, pp, vLLM's placement, config overrides)
    "qwen3-moe-tp2": ("Qwen3MoeForCausalLM", 2, 1, "linear", {}),
    # shared and routed experts in two groups placed round robin, and the MTP draft's
    # experts on the last stage
    "deepseek-v3-mtp-round-robin-tp2-pp2": (
        "DeepseekV3ForCausalLM", 2, 2, "round_robin",
        {"num_hidden_layers": 3, "num_nextn_predict_layers": 1},
    ),
}  # fmt: skip


def _source(arch: str, overrides: dict[str, Any]) -> SourceModel:
    config = archs.read_config(tiny_config(arch, **overrides))
    family = archs.target_family(config)[1]
    internal = archs.internal_draft_method(config)
    families = [family, *([archs.draft_family(internal, family.name)] if internal else [])]
    shapes = {n: s for part in families for n, s in quantized.expected_shapes(part, config).items()}
    return SourceModel(config, {name: ("BF16", shape) for name, shape in shapes.items()})


def _files(plan: Plan) -> list[tuple[str, list[Any]]]:
    return [(f.path, sorted((t.name, t.shape, t.blocks) for t in f.tensors)) for f in plan.files]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.vllm
@needs_vllm
def test_derived_expert_parallel_plan_equals_the_hand_written_one(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, tp, pp, placement, overrides = CASES[case]
    source = _source(arch, overrides)
    method = archs.internal_draft_method(source.config)
    request = ConversionRequest(
        tp=tp, pp=pp, expert_parallel=True, expert_placement=placement, draft_method=method
    )
    written = make_plan(source, request, source if method else None)
    monkeypatch.delitem(archs._TARGETS, arch)
    derived = make_plan(source, request, source if method else None)
    assert [m.family for m in derived.models] == ["derived"] * len(written.models)
    for mine, theirs in zip(derived.models, written.models, strict=True):
        assert mine.experts == theirs.experts and mine.experts is not None
        assert mine.experts.split.uses_ep
        assert mine.pieces == theirs.pieces
    assert _files(derived) == _files(written)


@pytest.mark.vllm
@needs_vllm
def test_rank_files_holding_other_experts_than_vllm_are_refused_naming_them() -> None:
    """The files of tp rank 0 given to rank 1 and back (experts 0-3 where vLLM loads 4-7),
    and the files of a plan without expert parallelism (every expert, cut tp ways)."""
    arch, tp, pp, placement, overrides = CASES["qwen3-moe-tp2"]
    source = _source(arch, overrides)
    plan = make_plan(source, ConversionRequest(tp=tp, pp=pp, expert_parallel=True))

    def problems(files: Any) -> list[str]:
        return rank_file_problems(
            source.config, source.shapes, plan.topology, "BF16", files, placement
        )

    assert problems(plan.files) == []
    swapped = [dataclasses.replace(f, tp=1 - f.tp) for f in plan.files]
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert (
        f"{w13} on rank (pp 0, tp 1) with expert parallelism: vLLM copies other regions "
        "into it than the plan does"
    ) in problems(swapped)
    cut = make_plan(source, ConversionRequest(tp=tp, pp=pp)).files
    assert (
        f"{w13} on rank (pp 0, tp 0) with expert parallelism: vLLM holds [4, 128, 128], "
        "the plan [8, 64, 128]"
    ) in problems(cut)


@pytest.mark.vllm
@needs_vllm
def test_experts_over_data_parallel_ranks_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = _source("Qwen3MoeForCausalLM", {})
    monkeypatch.delitem(archs._TARGETS, "Qwen3MoeForCausalLM")
    with pytest.raises(PlanError) as info:
        make_plan(source, ConversionRequest(tp=2, pp=1, dp=2, expert_parallel=True))
    assert str(info.value) == (
        "cannot convert: target: a derived layout of experts spread over data-parallel "
        "ranks is not proven against vLLM yet; leave --dp out, or --enable-expert-parallel"
    )
    assert DerivedFamily().check(source.config, 2, PlanContext(expert_parallel=True)) == []
