"""A tiny model's tensor table without its bytes, and one rank file's tensors of a plan."""

from __future__ import annotations

from typing import Any

from shardprep.demo.tiny import tiny_config
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.records import Plan, SourceModel, TensorPlan


def tiny_source(architecture: str, **overrides: Any) -> SourceModel:
    """The tensors (dtype and shape) a tiny checkpoint of `architecture` holds, quantized
    as `quantization_config` in `overrides` says."""
    config = tiny_config(architecture, **overrides)
    _, family = archs.target_family(config)
    dtypes = quantized.source_dtypes(family, config)
    shapes = quantized.expected_shapes(family, config)
    return SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})


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
