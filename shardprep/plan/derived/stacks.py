"""Which parameters of a derived layout stack experts: those whose writes, grouped by
source (infer.py), each lie in one dim-0 row of the parameter, one expert's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Sources = Mapping[str, tuple[str, tuple[int, ...]]]


def stacks_experts(
    shape: tuple[int, ...], groups: Sequence[tuple[str, int | None]], sources: Sources
) -> bool:
    """Whether a parameter of `shape` whose groups are (source, the dim-0 row it lies in,
    or None) stacks experts: several groups, each in one row, the row an expert's matrix
    (a 3-D stack) or an expert's vector from a 1-D source (a 2-D stack: compressed-tensors'
    [E, 2] `weight_shape`, one [N, K] an expert)."""
    if len(groups) < 2 or any(row is None for _, row in groups):
        return False
    if len(shape) == 3:
        return True
    return len(shape) == 2 and all(len(sources[source][1]) == 1 for source, _ in groups)
