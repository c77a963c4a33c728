"""A checkpoint's tensor table without its bytes (the one header builder of the plan
tests), and one rank file's tensors of a plan."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from shardprep.demo.tiny import tiny_config
from shardprep.plan import archs
from shardprep.plan.archs.base import Family, Layout, PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.records import Plan, SourceModel, TensorPlan

Tensors = Mapping[str, tuple[str, tuple[int, ...]]]


def source_model(
    config: dict[str, Any],
    *families: Family,
    dtype: str = "BF16",
    dtypes: Mapping[str, str] | None = None,
    drop: Collection[str] = (),
    extra: Tensors | None = None,
    **context: Any,
) -> SourceModel:
    """The tensors (dtype and shape) a checkpoint of `config` holds: those of `families`
    (the config's target family if none), quantized as its `quantization_config` says.
    Each is `dtype` but those `dtypes` names (None: the dtypes the families and the
    quantization store); `drop` leaves tensors out, `extra` adds or replaces some, and
    `context` goes to the families' `expected_shapes` (a draft's `target_config`)."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for family in families or (archs.target_family(config)[1],):
        stored = quantized.source_dtypes(family, config) if dtypes is None else dtypes
        shapes = quantized.expected_shapes(family, config, PlanContext(**context))
        tensors |= {n: (stored.get(n, dtype), s) for n, s in shapes.items() if n not in drop}
    return SourceModel(config, tensors | dict(extra or {}))


def tiny_source(architecture: str, **overrides: Any) -> SourceModel:
    """The tensors (dtype and shape) a tiny checkpoint of `architecture` holds, quantized
    as `quantization_config` in `overrides` says."""
    return source_model(tiny_config(architecture, **overrides))


def rank_tensors(plan: Plan, pp: int, tp: int, role: str | None = None) -> dict[str, TensorPlan]:
    """The tensors of the rank files of stage `pp`, tp rank `tp` (of `role` only, if given)."""
    return {
        t.name: t
        for f in plan.files
        if (f.pp, f.tp) == (pp, tp) and role in (None, f.role)
        for t in f.tensors
    }


def rank_shapes(plan: Plan, role: str, pp: int, tp: int) -> dict[str, tuple[str, tuple]]:
    """The dtype and shape of each tensor of one rank file of `role`."""
    return {name: (t.dtype, t.shape) for name, t in rank_tensors(plan, pp, tp, role).items()}


def assert_derived_like_written(derived: Plan, written: Plan) -> None:
    """A plan whose target and draft were derived from vLLM (plan/derived) holds what the
    hand-written families' plan does: the same pieces, sharing and skips, in the same files."""
    assert [(m.role, m.family) for m in derived.models] == [
        ("target", "derived"),
        ("draft", "derived"),
    ]
    for mine, theirs in zip(derived.models, written.models, strict=True):
        assert mine.pieces == theirs.pieces, mine.role
        assert mine.shared_with_target == theirs.shared_with_target
        assert mine.spec_decode_only == theirs.spec_decode_only
        assert {n for n, _ in mine.skipped} == {n for n, _ in theirs.skipped}
    assert [f.path for f in derived.files] == [f.path for f in written.files]


def assert_same_layout(derived: Layout, written: Layout) -> None:
    """A layout derived from vLLM equals a family's, piece for piece."""
    assert {p.name: p for p in derived.params} == {p.name: p for p in written.params}
    assert set(derived.skipped) == set(written.skipped)
    assert derived.shared_with_target == written.shared_with_target
    assert derived.num_experts == written.num_experts
