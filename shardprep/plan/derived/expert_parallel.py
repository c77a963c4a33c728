"""A derived layout under expert parallelism. The layout is derived without it, and the
planner places whole experts on each rank as it does for every family
(plan/topology.py `ExpertSplit`). What it plans is then checked against what vLLM's own
`load_weights` does on each rank with expert parallelism on (probe.py, vLLM's experts
placed as the plan places them): every parameter vLLM loads, in the plan's rank file of
the same shape, made of the same regions of the same checkpoint tensors in the same
order. A parameter that differs is one problem naming it and the rank, never a guess."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from shardprep.errors import PlanError
from shardprep.format.dtypes import MODEL_DTYPES
from shardprep.format.records import Topology
from shardprep.plan.derived.drafts import split_shared
from shardprep.plan.derived.overwrites import last_writes
from shardprep.plan.derived.placeholders import placeholders
from shardprep.plan.derived.regions import (
    Fill,
    block_region,
    contiguous_span,
    merged,
    normal,
    zeros,
)
from shardprep.plan.records import FilePlan, TensorPlan

Shapes = Mapping[str, tuple[int, ...]]


def rank_file_problems(
    config: Mapping[str, Any],
    shapes: Shapes,
    topology: Topology,
    dtype: str,
    files: Sequence[FilePlan],
    placement: str,
    draft: str | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> list[str]:
    """What the rank `files` planned for `shapes` (the target's, or `draft`'s) hold
    otherwise than vLLM's parameters, built in `dtype` (a safetensors name) with its
    experts placed by `placement`; `dtypes`: the checkpoint's (derived/placeholders.py)."""
    from shardprep.plan.derived.run import rank_records  # the child that runs vLLM

    tensors = placeholders(shapes, dtypes or {}, dtype)
    vllm_dtype = {v: k for k, v in MODEL_DTYPES.items()}[dtype]
    problems: list[str] = []
    with rank_records(
        config, tensors, topology, vllm_dtype, draft=draft, expert_placement=placement
    ) as (_, records):
        for record in records:
            record, _ = split_shared(record)  # the draft's, which vLLM replaces: not planned
            p, t = record["rank"]
            planned = {x.name: x for f in files if (f.pp, f.tp) == (p, t) for x in f.tensors}
            problems += _rank_problems(record, planned, shapes)
    return problems


def _rank_problems(
    record: Mapping[str, Any], planned: Mapping[str, TensorPlan], shapes: Shapes
) -> list[str]:
    p, t = record["rank"]
    writes: dict[str, list[Sequence[Any]]] = defaultdict(list)
    for op in last_writes(record["ops"]):  # what vLLM's state finally holds
        writes[op[1]].append(op)
    problems = []
    for name, (_, shape) in record["params"].items():
        if not writes[name]:  # vLLM loads nothing into it (fp8's KV-cache scales)
            continue
        where = f"{name} on rank (pp {p}, tp {t}) with expert parallelism"
        tensor = planned.get(name)
        if tensor is None:
            problems.append(f"{where}: vLLM loads it, and the plan has no such tensor")
        elif tuple(tensor.shape) != tuple(shape):
            problems.append(f"{where}: vLLM holds {list(shape)}, the plan {list(tensor.shape)}")
        elif _recorded(writes[name], math.prod(shape)) != _planned(tensor, shapes):
            problems.append(f"{where}: vLLM copies other regions into it than the plan does")
    return problems


def _recorded(ops: list[Sequence[Any]], total: int) -> list[Fill] | None:
    """What vLLM wrote into a parameter, in its order (zeros it wrote while it built the
    model included); None where it leaves part unwritten, writes part twice or writes a
    value of its own (no plan of one copy or zero per value is that)."""
    spans = []
    for op in ops:
        offset, sizes, strides = op[2]
        try:
            start, end = contiguous_span(normal(offset, sizes, strides), op[1])
        except PlanError:
            return None
        if start == end:
            continue
        if op[0] != "copy" and op[3] != 0:  # a value of vLLM's own: no plan writes it
            return None
        fill = zeros(end - start) if op[0] != "copy" else (op[3], normal(*op[4]))
        spans.append((start, end, fill))
    spans.sort(key=lambda span: span[0])
    position = 0
    for start, end, _ in spans:
        if start != position:
            return None
        position = end
    return merged([fill for _, _, fill in spans]) if position == total else None


def _planned(tensor: TensorPlan, shapes: Shapes) -> list[Fill] | None:
    width = math.prod(tensor.stacked_shape[1:])
    try:
        fills = [
            block_region(block, tuple(shapes.get(block.source or "", ())), width)
            for block in tensor.blocks
        ]
    except PlanError:  # a block of a kind no record shows (padding, a repeated block)
        return None
    return merged(fills)
