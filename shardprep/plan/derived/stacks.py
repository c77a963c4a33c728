"""Which derived parameters stack experts, besides the 3-D ones: a vector or a matrix that
holds one value per expert (and per part of a fused layer), as a mixture of experts keeps
the per-tensor scales of its experts ([experts] or [experts, parts]).

What tells such a stack from a fused layer's vector of per-part values (a qkv's three
scales) is only where it stands: beside a 3-D stack of the same module with as many rows
(the experts), each of its rows made of whole one-value sources. Its pieces are one value
of an expert each (`Cut.PER_TENSOR` with the expert), which gives its shape either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardprep.plan.cuts import Cut, Piece

# The rows (experts) of each module's 3-D parameters.
Stacks = Mapping[str, frozenset[int]]
Sources = Mapping[str, tuple[str, tuple[int, ...]]]


def expert_rows(params: Mapping[str, Any]) -> Stacks:
    """The dim 0 of the 3-D parameters of each module of a rank's record."""
    found: dict[str, set[int]] = {}
    for name, (_, shape) in params.items():
        if len(shape) == 3:
            found.setdefault(_module(name), set()).add(shape[0])
    return {module: frozenset(rows) for module, rows in found.items()}


def stacks_values(
    name: str,
    shape: Sequence[int],
    groups: Sequence[tuple[str, int | None, Any]],
    sources: Sources,
    stacks: Stacks,
) -> bool:
    """Whether a 1-D or 2-D parameter whose every source (one value each) lies in one row
    stacks experts: its module holds a 3-D stack of as many rows."""
    if len(shape) not in (1, 2) or shape[0] not in stacks.get(_module(name), ()):
        return False
    return all(
        index is not None and math.prod(sources[source][1]) == 1 for source, index, _ in groups
    )


def value_piece(source: str, expert: int | None) -> Piece:
    """An expert's one value in a stack of them: the cut preferred for such a stack."""
    return Piece(source, Cut.PER_TENSOR, expert=expert)


def _module(name: str) -> str:
    return name.rpartition(".")[0]
