"""The one form both sides of a derived layout are compared in: a region of a tensor as
(offset, sizes, strides) with unit dimensions dropped and contiguous ones merged. A
recorded copy `parameter[region] <- source[region]` and a plan `Block` of a source of
known shape reduce to the same form exactly when they read the same elements in the
same order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from shardprep.errors import PlanError
from shardprep.plan.cuts import Block

Region = tuple[int, tuple[int, ...], tuple[int, ...]]
# What fills one span of a parameter: a source's region, or (None, n elements) for zeros.
Fill = tuple[str | None, Region]


def normal(offset: int, sizes: Sequence[int], strides: Sequence[int]) -> Region:
    """The region with unit dimensions dropped and adjacent contiguous ones merged; an
    empty region is (0, (0,), (1,))."""
    if any(size == 0 for size in sizes):
        return (0, (0,), (1,))
    dims = [(size, stride) for size, stride in zip(sizes, strides, strict=True) if size != 1]
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if merged and merged[-1][1] == size * stride:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if not merged:
        return (offset, (1,), (1,))
    return (offset, tuple(s for s, _ in merged), tuple(st for _, st in merged))


def numel(region: Region) -> int:
    count = 1
    for size in region[1]:
        count *= size
    return count


def contiguous_span(region: Region, what: str) -> tuple[int, int]:
    """[start, end) of a region that is one contiguous run of a tensor's elements."""
    _, sizes, strides = region
    if len(sizes) != 1 or strides[0] != 1:
        raise PlanError(
            f"vLLM's load_weights writes {what} in a strided region (sizes {list(sizes)}, "
            f"strides {list(strides)}), which a plan of whole rows cannot express"
        )
    return region[0], region[0] + sizes[0]


def zeros(count: int) -> Fill:
    return None, (0, (count,), (1,))


def _slab_region(block: Block, shape: tuple[int, ...]) -> Region:
    """The part of one dim-0 row (an expert's matrix) of a 3-D source a slab block reads,
    where it fills its slab whole (no padding around it)."""
    assert block.slab is not None
    (r0, r1), (c0, c1), size = block.slab
    rows, cols = (shape[1], math.prod(shape[2:])) if len(shape) > 2 else (1, shape[-1])
    if len(shape) < 2 or size != (r1 - r0, c1 - c0):
        raise PlanError(f"{block.source}: a padded block has no derived form")
    offset = (block.rows[0] * rows + r0) * cols + c0
    return normal(offset, (r1 - r0, c1 - c0), (cols, 1))


def _matrix_region(block: Block, shape: tuple[int, ...]) -> Region:
    """The part of one dim-0 row (an expert's [A, B] matrix) of a 3-D source a transposed
    block reads, in the order it is written: its columns, each the run of its rows."""
    assert block.matrix is not None
    (r0, r1), (c0, c1) = block.matrix
    if len(shape) != 3 or block.rows[1] - block.rows[0] != 1:
        raise PlanError(f"{block.source}: a transposed block of this shape has no derived form")
    offset = (block.rows[0] * shape[1] + r0) * shape[2] + c0
    return normal(offset, (c1 - c0, r1 - r0), (1, shape[2]))


def block_region(block: Block, shape: tuple[int, ...], row_width: int) -> Fill:
    """What a plan block reads from a source of `shape`, in the normal form; a zero block
    of a parameter whose rows hold `row_width` elements is that many zeros per row."""
    if block.source is None:
        return zeros((block.rows[1] - block.rows[0]) * row_width)
    if block.slab is not None and block.repeat == (1, 1) and block.matrix is None:
        (r0, r1), (c0, c1), (height, width) = block.slab
        if r0 == r1 or c0 == c1:  # nothing of the source: the slab is zeros
            return zeros(height * width * (block.rows[1] - block.rows[0]))
        return block.source, _slab_region(block, shape)
    if block.matrix is not None and block.repeat == (1, 1) and block.slab is None:
        return block.source, _matrix_region(block, shape)
    if block.repeat != (1, 1) or block.matrix is not None or block.slab is not None:
        raise PlanError(f"{block.source}: a block of this kind has no derived form")
    width = 1
    for size in shape[1:]:
        width *= size
    rows = block.rows[1] - block.rows[0]
    if block.cols is None:
        return block.source, normal(block.rows[0] * width, (rows, width), (width, 1))
    cols = block.cols[1] - block.cols[0]
    return block.source, normal(block.rows[0] * width + block.cols[0], (rows, cols), (width, 1))


def merged(fills: list[Fill]) -> list[Fill]:
    """Adjacent regions of one source that continue each other as one (a cut's blocks
    and vLLM's copies may split the same run differently); zeros merged likewise."""
    out: list[Fill] = []
    for source, region in fills:
        if out and source is None and out[-1][0] is None:
            out[-1] = zeros(out[-1][1][1][0] + region[1][0])
        elif out and source is not None and out[-1][0] == source and continues(out[-1][1], region):
            previous = out[-1][1]
            out[-1] = (source, (previous[0], (previous[1][0] + region[1][0],), (1,)))
        else:
            out.append((source, region))
    return out


def continues(a: Region, b: Region) -> bool:
    flat = len(a[1]) == 1 and len(b[1]) == 1 and a[2] == (1,) and b[2] == (1,)
    return flat and a[0] + a[1][0] == b[0]


def span(region: Sequence[Any]) -> tuple[int, int]:
    """The first and one past the last element a region (offset, sizes, strides) touches."""
    offset, sizes, strides = region
    if any(size == 0 for size in sizes):
        return offset, offset
    last = offset + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))
    return offset, last + 1


def is_contiguous(region: Sequence[Any]) -> bool:
    """Whether a region is one run of elements (its span is exactly what it covers)."""
    _, sizes, strides = normal(*region)
    return len(sizes) == 1 and strides[0] == 1
