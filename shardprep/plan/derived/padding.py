"""Zero rows a rank's parameter ends with that vLLM fills while it builds the model and
its `load_weights` never writes (the record's `built` ops, built.py): a fused layer
padding each rank's output to a multiple of some rows for its GEMM. In a plan that is an
ALIGN_ROWS piece after the parameter's last: zero rows up to a multiple of its rows.

One tp shows the rank's zero rows, not the multiple vLLM aligns to: every multiple that
leaves as many zero rows on every rank gives the same rank files at that tp, but not at a
coarser tp served from them. So the ranks of every coarser tp are built too (run.py), and
the multiple is the smallest power of two, as GEMM alignments are, that gives the rows vLLM
builds at each: (loaded rows, built rows) observed, built = loaded rounded up to it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
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


def align_piece(name: str, observed: Iterable[tuple[int, int]], last: Piece) -> Piece | str:
    """The ALIGN_ROWS piece (of the source of the parameter's `last` piece) that rounds
    each rank's loaded rows up to the rows vLLM builds, at every tp `observed` ((loaded,
    built) rows of a rank), or the one-line problem where no power of two does."""
    seen = sorted(set(observed))
    multiple = aligned_multiple(seen)
    if multiple is None:
        shown = ", ".join(f"{loaded} to {built}" for loaded, built in seen)
        return (
            f"{name}: vLLM builds zero rows after the rows it loads into it ({shown} at the "
            "tps derived), which no multiple of a power of two gives; a plan of aligned rows "
            "does not express that padding"
        )
    return Piece(last.source, Cut.ALIGN_ROWS, multiple)


def aligned_multiple(observed: Sequence[tuple[int, int]]) -> int | None:
    """The smallest power of two that rounds each loaded row count up to its built one."""
    multiple, top = 1, max(built for _, built in observed)
    while multiple <= top:
        if all(-(-loaded // multiple) * multiple == built for loaded, built in observed):
            return multiple
        multiple <<= 1
    return None
