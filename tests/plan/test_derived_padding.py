"""Zero rows vLLM builds into a parameter and never loads (plan/derived/built.py records
them in the deriving child, plan/derived/padding.py reads them): the fill is recorded by
the parameter it fills, what the load leaves of it reaches the record, and the inference
plans it as an ALIGN_ROWS piece, or refuses in one line where no alignment gives it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardprep.errors import PlanError
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.derived.built import BuiltFills, left_by_load
from shardprep.plan.derived.infer import Inference
from shardprep.plan.derived.padding import aligned_multiple


class _Padded(nn.Module):
    """A layer that zeroes its weight's last two rows as it is built (a fused projection
    padding its output), beside a scratch tensor it fills and keeps no parameter of."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(8, 4))
        self.bias = nn.Parameter(torch.empty(8))
        self.weight.data[-2:].zero_()
        torch.empty(3).fill_(7.0)


def test_a_fill_while_the_model_is_built_is_recorded_by_the_parameter_it_fills() -> None:
    built = BuiltFills()
    with torch.device("meta"), built:
        layer = _Padded()
    assert built.of_params(dict(layer.named_parameters())) == [
        ["built", "weight", [24, [2, 4], [4, 1]], 0.0]
    ]


def _copy(param: str, start: int, count: int) -> list[Any]:
    return ["copy", param, [start, [count], [1]], "w", [start, [count], [1]], "F32"]


def test_the_part_of_a_built_fill_no_load_write_covers_reaches_the_record() -> None:
    built = [
        ["built", "p", [16, [4, 4], [4, 1]], 0.0],  # rows 4-7, the load writes rows 0-5
        ["built", "q", [0, [8], [1]], 0.0],  # the load writes all of it
        ["built", "r", [0, [8], [1]], 1.0],  # the load writes none of it: left as built
    ]
    ops = [_copy("p", 0, 24), _copy("q", 0, 8)]
    assert left_by_load(built, ops) == [["built", "p", [24, [8], [1]], 0.0]]


def _record(ops: list[list[Any]], rank: int, rows: int = 4) -> dict[str, Any]:
    params = {"p": ["F32", [rows, 2]]}
    return {"rank": [0, rank], "model_dtype": "F32", "params": params, "ops": ops}


def _rank(rank: int, rows: int, zeros: int, value: float = 0.0) -> list[list[Any]]:
    """Rank `rank` copies its `rows` rows of w [6, 2] into p, then p's next `zeros` rows
    are what vLLM built."""
    start = rank * rows * 2
    copy = ["copy", "p", [0, [rows, 2], [2, 1]], "w", [start, [rows, 2], [2, 1]], "F32"]
    return [copy, ["built", "p", [rows * 2, [zeros * 2], [1]], value]]


def test_zero_rows_built_at_the_end_and_never_loaded_are_an_aligned_piece() -> None:
    """Rows 3 a rank, padded to 4 with one built zero row: aligned to 2 rows (a power of
    two above one row that divides 4), which gives that one row at tp 2."""
    inference = Inference({}, {"w": ("F32", (6, 2))}, 2)
    for rank in (0, 1):
        inference.add(_record(_rank(rank, 3, 1), rank))
    (param,) = inference.layout().params
    assert param.pieces == (Piece("w", Cut.ROWS), Piece("w", Cut.ALIGN_ROWS, 2))


def test_built_zero_rows_no_power_of_two_aligns_to_are_refused_in_one_line() -> None:
    """Rows 3 a rank and two built zero rows: 5 rows, no multiple of a power of two above 2."""
    inference = Inference({}, {"w": ("F32", (6, 2))}, 2)
    for rank in (0, 1):
        inference.add(_record(_rank(rank, 3, 2), rank, rows=5))
    with pytest.raises(PlanError) as info:
        inference.layout()
    assert str(info.value) == (
        "cannot derive the layout: 1 parameter(s): p: vLLM builds zero rows after the rows it "
        "loads into it (3 to 5 at the tps derived), which no multiple of a power of two gives; "
        "a plan of aligned rows does not express that padding"
    )


def test_the_rows_a_coarser_tp_builds_pin_the_multiple_one_tp_leaves_open() -> None:
    """Kimi-K3's KDA at tp8: 12 rows a rank padded to 16, which a multiple of 8 gives as
    well as 16; at tp4 vLLM pads 24 rows to 32, which only 16 gives."""
    inference = Inference({}, {"w": ("F32", (96, 2))}, 8)
    for rank in range(8):
        inference.add(_record(_rank(rank, 12, 4), rank, rows=16))
    assert inference.padded() == ["p"]
    assert inference.layout().params[0].pieces[-1] == Piece("w", Cut.ALIGN_ROWS, 8)
    inference.observe_rows("p", 24, 32)  # tp4
    inference.observe_rows("p", 48, 48)  # tp2: nothing to pad
    assert inference.layout().params[0].pieces[-1] == Piece("w", Cut.ALIGN_ROWS, 16)


@pytest.mark.parametrize(
    "observed, multiple",
    [
        ([(3, 4)], 2),
        ([(5, 8)], 4),
        ([(12, 16), (24, 32), (48, 48), (96, 96)], 16),
        ([(7, 7)], 1),
        ([(3, 5)], None),
        ([(12, 16), (20, 20)], None),  # 8 rounds 20 up to 24, 16 to 32, 4 leaves 12
    ],
)
def test_the_multiple_is_the_smallest_power_of_two_that_gives_every_rows_built(
    observed: list[tuple[int, int]], multiple: int | None
) -> None:
    assert aligned_multiple(observed) == multiple


def test_a_built_value_other_than_zero_is_refused_naming_the_parameter() -> None:
    inference = Inference({}, {"w": ("F32", (6, 2))}, 2)
    with pytest.raises(PlanError, match="fills p with 1.0"):
        inference.add(_record(_rank(0, 3, 1, value=1.0), 0))
