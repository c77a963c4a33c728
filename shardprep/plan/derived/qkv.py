"""The cut of a source a rank reads in three runs, its q, k and v rows apart (a gated
DeltaNet's `conv1d`): QKV_ROWS, its k part told by where the rank's second run starts."""

from __future__ import annotations

import math

from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.derived.regions import Fill, merged


def qkv_candidates(
    source: str, shape: tuple[int, ...], fills: list[Fill], tp: int, rank: int
) -> list[Piece]:
    """QKV_ROWS for a source a rank reads in three runs (its q rows, its k rows, its v
    rows: a gated DeltaNet's conv1d), its k part as long as q, told by where the rank's
    second run starts (k's start plus the rank's share of k): the other ranks confirm it."""
    runs = [region for name, region in merged(fills) if name is not None]
    width = math.prod(shape[1:])
    if len(runs) != 3 or not width or runs[1][0] % width:
        return []
    part, extra = divmod(runs[1][0] // width * tp, tp + rank)
    if extra or part <= 0 or 2 * part >= shape[0]:
        return []
    return [Piece(source, Cut.QKV_ROWS, heads=part)]
