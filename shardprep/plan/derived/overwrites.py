"""Writes of vLLM's `load_weights` into a region of a parameter that later writes cover
again. What vLLM leaves there is the later value, so the provenance of a value is the
last write that covered it, and a plan, which writes each value once, takes it from
there: an earlier write that later ones cover whole is no piece. One covered only in part
is kept, for the inference to refuse (infer.py: "writes twice").

It happens in targets and drafts alike: FusedMoE loads an expert's gate and up
`input_scale` (or compressed-tensors' `weight_shape`) into the same slot, up's last in
the checkpoint's order; DeepSeek's MTP loads the embedding twice, the first MTP layer's
copy last."""

from __future__ import annotations

import bisect
from typing import Any

from shardprep.plan.derived.regions import is_contiguous, span

Op = list[Any]  # ["copy", param, region, source, region, dtype] or ["fill", param, region, value]


class _Covered:
    """The element ranges of one parameter that later writes cover, merged."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def covers(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and end <= self.ends[i]

    def add(self, start: int, end: int) -> None:
        lo = bisect.bisect_left(self.ends, start)  # the first range that ends at or after start
        hi = bisect.bisect_right(self.starts, end)  # past the last that starts at or before end
        if lo < hi:
            start, end = min(start, self.starts[lo]), max(end, self.ends[hi - 1])
        self.starts[lo:hi], self.ends[lo:hi] = [start], [end]


def final_writes(ops: list[Op]) -> tuple[list[Op], dict[str, str]]:
    """The ops without every write that later writes into the same parameter cover whole,
    in their order; and the checkpoint tensors that only such writes read, each with the
    parameter it was overwritten in."""
    covered: dict[str, _Covered] = {}
    kept: list[Op] = []
    dropped: dict[str, str] = {}
    for op in reversed(ops):
        start, end = span(op[2])
        where = covered.setdefault(op[1], _Covered())
        if start < end and where.covers(start, end):
            if op[0] == "copy":
                dropped.setdefault(op[3], op[1])
            continue
        kept.append(op)
        if start < end and is_contiguous(op[2]):
            where.add(start, end)
    kept.reverse()
    read = {op[3] for op in kept if op[0] == "copy"}
    return kept, {source: param for source, param in dropped.items() if source not in read}


def last_writes(ops: list[Op]) -> list[Op]:
    """The ops with every write dropped that later writes into its parameter cover whole."""
    return final_writes(ops)[0]
