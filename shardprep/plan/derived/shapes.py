"""What the shape of a parameter vLLM builds says of its derived pieces (infer.py): a 0-d
parameter holds the one value of its source, a scalar or [1]."""

from __future__ import annotations

import math
from collections.abc import Mapping

from shardprep.plan.cuts import Cut, Piece

Sources = Mapping[str, tuple[str, tuple[int, ...]]]


def one_value(shape: tuple[int, ...], source: str, source_shape: tuple[int, ...]) -> list[Piece]:
    """SCALAR for a 0-d parameter of `shape` that a source of one value fills (a KV-cache
    scale the checkpoint stores as a scalar or as [1]); nothing for any other."""
    if shape or math.prod(source_shape) != 1:
        return []
    return [Piece(source, Cut.SCALAR)]
