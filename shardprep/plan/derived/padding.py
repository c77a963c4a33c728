"""Zero rows a rank's parameter ends with that vLLM fills while it builds the model and
its `load_weights` never writes (the record's `built` ops, built.py): a fused layer
padding each rank's output to a multiple of some rows for its GEMM. In a plan that is an
ALIGN_ROWS piece after the parameter's last: zero rows up to a multiple of its rows.

One tp shows the rank's zero rows, not the multiple vLLM aligns to: every multiple that
leaves as many zero rows on every rank gives the same plan at that tp. The smallest power
of two above the most zero rows a rank has is taken, as GEMM alignments are."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardprep.plan.cuts import Cut, Piece


def built_tails(
    ops: Sequence[list[Any]], params: Mapping[str, Any]
) -> tuple[list[list[Any]], dict[str, int]]:
    """The ops with every built zero fill that ends its parameter in whole rows taken out,
    and those fills' rows per parameter; any other built fill as a plain fill (zeros
    join the piece before them, another value is refused)."""
    kept: list[list[Any]] = []
    tails: dict[str, int] = {}
    for op in ops:
        if op[0] != "built":
            kept.append(op)
            continue
        shape = params[op[1]][1]
        offset, sizes, strides = op[2]
        total, width = math.prod(shape), math.prod(shape[1:])
        whole = len(sizes) == 1 and strides == [1] and offset + sizes[0] == total
        if op[3] == 0 and whole and width and offset % width == 0 and sizes[0] % width == 0:
            tails[op[1]] = sizes[0] // width
        else:
            kept.append(["fill", *op[1:]])
    return kept, tails


def align_piece(name: str, shape: Sequence[int], rows: int, last: Piece) -> Piece | str:
    """The ALIGN_ROWS piece (of the source of the parameter's `last` piece) that pads each
    rank with at most `rows` zero rows, or the one-line problem where no power of two
    does (the parameter's rows are not a multiple of one above them)."""
    multiple = 1 << rows.bit_length()  # the smallest power of two above `rows`
    while multiple <= shape[0] and shape[0] % multiple:
        multiple <<= 1
    if multiple > shape[0]:
        return (
            f"{name}: vLLM builds its last {rows} row(s) as zeros and loads nothing into "
            f"them, but its {shape[0]} rows are no multiple of a power of two above that, "
            "a padding a plan of aligned rows does not express"
        )
    return Piece(last.source, Cut.ALIGN_ROWS, multiple)
