"""Regions of checkpoint placeholders that vLLM's `load_weights` sets to a constant in
place (`zero_`, `fill_`) before it copies them into a parameter: what such a copy writes
is that constant, a fill, not the checkpoint's bytes. Kept by the probe (probe.py) per
rank, as (offset, sizes, strides) of the placeholder's storage, so that a later read is
known to lie inside one (a fill), outside every one (a copy) or across one's edge
(refused: part constant, part checkpoint is not one write a plan records).

Pure arithmetic on regions: it runs in the probe's child, and its tests need no vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardprep.plan.derived.regions import Region, normal

Raw = Sequence[Any]  # a region as the probe records it: [offset, [sizes], [strides]]


class Mixed(Exception):
    """A read that lies partly inside a constant region and partly outside it."""


def bounds(region: Region) -> tuple[int, int]:
    """[first, last] elements of the storage a region touches (strides are never negative)."""
    offset, sizes, strides = region
    span = sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))
    return offset, offset + span


@dataclass
class Constants:
    """The constant regions of each placeholder's storage (keyed as the probe keys them)."""

    regions: dict[int, list[tuple[Region, float]]] = field(default_factory=dict)

    def set(self, key: int, raw: Raw, value: float) -> None:
        """The region `raw` (offset, sizes, strides) of storage `key` now holds `value`."""
        self.regions.setdefault(key, []).append((normal(*raw), value))

    def value(self, key: int, raw: Raw) -> float | None:
        """The constant a read of this region gives, None where it reads no constant region;
        Mixed where it reads part of one, or of two with different values."""
        read = normal(*raw)
        first, last = bounds(read)
        values = set()
        for region, value in self.regions.get(key, ()):
            start, end = bounds(region)
            if end < first or last < start:
                continue
            if not _inside(read, region):
                raise Mixed
            values.add(value)
        if len(values) > 1:
            raise Mixed
        return values.pop() if values else None


def _inside(read: Region, region: Region) -> bool:
    """Whether every element of `read` is one of `region`'s: the same region, or any read
    within the span of a region that is one contiguous run."""
    if read == region:
        return True
    _, sizes, strides = region
    if len(sizes) != 1 or strides[0] != 1:
        return False
    start, end = bounds(region)
    first, last = bounds(read)
    return start <= first and last <= end
