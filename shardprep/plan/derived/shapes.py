"""What the shape of a parameter vLLM builds says of its derived pieces (infer.py): it
stacks experts where its writes, grouped by source, each lie in one dim-0 row, one
expert's; a 0-d parameter holds the one value of its source, a scalar or [1]."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from shardprep.plan.cuts import Cut, Piece

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


def one_value(shape: tuple[int, ...], source: str, source_shape: tuple[int, ...]) -> list[Piece]:
    """SCALAR for a 0-d parameter of `shape` that a source of one value fills (a KV-cache
    scale the checkpoint stores as a scalar or as [1]); nothing for any other."""
    if shape or math.prod(source_shape) != 1:
        return []
    return [Piece(source, Cut.SCALAR)]
