"""Expert stacks in a derived layout: a parameter that holds a layer's experts along dim 0
(vLLM's routed experts, `w13_weight` [E, 2I/tp, H], `w2_bias` [E, H], ...) is made of a
piece per expert, as the hand-written families make it, so that a rank under expert
parallelism keeps only its own experts' pieces.

vLLM may fill every expert of a stack in one write: a copy from a checkpoint tensor that
stacks the experts too (dim 0 the expert, the rest possibly transposed), or one zero fill
where a rank takes nothing of a tensor (a bias added once, on rank 0). Such a write is
read as one write per expert, the expert's row of the source in the same order; an
expert filled only with zeros on a rank is a piece of the tensor it is cut from on the
ranks read before.

The probe says which parameters are stacks (`expert_stacks`, run in vLLM's child);
the rest is arithmetic on regions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from shardprep.errors import PlanError
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.derived.regions import Fill, Region, normal, numel, zeros

Write = tuple[int, int, Fill]  # [start, end) of a parameter's elements, and what fills it
Group = tuple[str, int | None, list[Fill]]  # a source, its expert, its fills in order


def expert_stacks(model: Any) -> list[str]:
    """The parameters of `model` that stack experts along dim 0: those with as many rows
    as the experts of the module that owns them (vLLM's routed-experts layer says how many
    it holds: `local_num_experts`), matrices and vectors of per-expert values alike."""
    found = []
    for prefix, module in model.named_modules():
        experts = getattr(module, "local_num_experts", None)
        if not isinstance(experts, int) or experts < 1:
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() >= 1 and param.shape[0] == experts:
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


def per_expert(write: Write, shape: tuple[int, ...]) -> list[Write]:
    """A write that fills whole experts (dim-0 rows) of a stack of `shape`, one per expert,
    each reading its share of the source in order; a write that does not fill whole
    experts, or whose source region does not split so, as it is."""
    start, end, (source, region) = write
    row = math.prod(shape[1:])
    count = (end - start) // row if row else 0
    if count < 2 or start % row or end % row:
        return [write]
    if source is None:
        return [(start + i * row, start + (i + 1) * row, zeros(row)) for i in range(count)]
    parts = split_region(region, count)
    if parts is None:
        return [write]
    return [
        (start + i * row, start + (i + 1) * row, (source, part)) for i, part in enumerate(parts)
    ]


def split_region(region: Region, count: int) -> list[Region] | None:
    """The region's elements, in its order, as `count` consecutive regions of as many
    elements each; None where a part is no (offset, sizes, strides) region."""
    offset, sizes, strides = region
    total = numel(region)
    if total % count:
        return None
    chunk, inner = total // count, 1
    for dim in reversed(range(len(sizes))):
        if inner * sizes[dim] >= chunk:
            break
        inner *= sizes[dim]
    else:
        return None
    if chunk % inner or sizes[dim] % (chunk // inner):
        return None
    run = chunk // inner  # of dim `dim`, the rest of which is outside a part
    outer = (*sizes[:dim], sizes[dim] // run)
    steps = (*strides[:dim], strides[dim] * run)
    within = ((run, *sizes[dim + 1 :]), (strides[dim], *strides[dim + 1 :]))
    return [
        normal(offset + sum(i * s for i, s in zip(index, steps, strict=True)), *within)
        for index in itertools.product(*(range(size) for size in outer))
    ]


def expert_groups(
    name: str,
    shape: tuple[int, ...],
    writes: list[Write],
    before: Mapping[int | None, str],
    rank: tuple[int, int],
) -> list[Group] | None:
    """The writes of a stack, a group per expert (dim-0 row), where each expert is read
    from one source, and one source fills several experts or an expert is only zeros on
    this rank; `before`: each expert's source on the ranks read before. None where the
    stack is not such (each expert's tensors of its own, read by the general grouping)."""
    row = math.prod(shape[1:])
    rows: dict[int, list[Write]] = {}
    position = 0
    for write in sorted(writes, key=lambda w: w[0]):
        if not row or write[0] // row != (write[1] - 1) // row or write[0] != position:
            return None  # the general grouping says what is wrong, if anything
        position = write[1]
        rows.setdefault(write[0] // row, []).append(write)
    if position != math.prod(shape):
        return None
    sources = [{w[2][0] for w in rows[e] if w[2][0] is not None} for e in sorted(rows)]
    if any(len(s) > 1 for s in sources):
        return None
    shared = len({next(iter(s)) for s in sources if s}) < sum(1 for s in sources if s)
    if not shared and all(sources):
        return None
    groups: list[Group] = []
    for expert, own in zip(sorted(rows), sources, strict=True):
        source = next(iter(own)) if own else before.get(expert)
        if source is None:
            raise PlanError(
                f"vLLM's load_weights fills expert {expert} of {name} with zeros alone on "
                f"rank (pp {rank[0]}, tp {rank[1]}), the first rank read of it; which "
                "checkpoint tensor it is cut from cannot be told"
            )
        groups.append((source, expert, [w[2] for w in rows[expert]]))
    return groups


def one_value_each(
    shape: tuple[int, ...], groups: list[Group], sources: Mapping[str, tuple[str, tuple[int, ...]]]
) -> bool:
    """Whether a stack of per-expert values ([experts] or [experts, parts]: the per-tensor
    scales of a mixture of experts) is made of one-value sources, each in its expert's row.
    Its pieces are then one value of an expert each (`value_piece`), which gives its shape
    either way."""
    if len(shape) not in (1, 2):
        return False
    return all(
        index is not None and math.prod(sources[source][1]) == 1 for source, index, _ in groups
    )


def value_piece(source: str, expert: int | None) -> Piece:
    """An expert's one value in a stack of them: the cut preferred for such a stack."""
    return Piece(source, Cut.PER_TENSOR, expert=expert)
