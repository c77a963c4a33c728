"""Expert stacks vLLM fills in one write, and checkpoint regions it sets to a constant in
place, in a derived layout (plan/derived/experts.py, constants.py): records made by
vLLM's own probe code on meta tensors where torch alone suffices, no vLLM."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardprep.errors import PlanError
from shardprep.plan.cuts import Cut, Piece, ScaleOf
from shardprep.plan.derived.constants import Constants, Mixed
from shardprep.plan.derived.experts import per_expert, split_region
from shardprep.plan.derived.infer import Inference
from shardprep.plan.derived.probe import Recorder, Refused
from shardprep.plan.derived.regions import zeros


def _record(rank: int, ops: list[list[Any]], params: dict[str, Any]) -> dict[str, Any]:
    return {
        "rank": [0, rank],
        "model_dtype": "F32",
        "params": params,
        "ops": ops,
        "expert_stacks": list(params),
    }


def test_a_zeroed_region_reads_as_zero_inside_none_outside_and_mixed_across() -> None:
    constants = Constants()
    constants.set(7, (4, [2, 4], [4, 1]), 0.0)  # rows 1 and 2 of a [4, 4] tensor
    assert constants.value(7, (4, [1, 4], [4, 1])) == 0.0
    assert constants.value(7, (6, [2, 2], [4, 1])) == 0.0  # columns 2, 3 of both rows
    assert constants.value(7, (0, [1, 4], [4, 1])) is None
    assert constants.value(8, (4, [1, 4], [4, 1])) is None  # another tensor
    with pytest.raises(Mixed):
        constants.value(7, (0, [2, 4], [4, 1]))
    strided = Constants()
    strided.set(1, (0, [4, 2], [4, 1]), 0.0)  # columns 0, 1 of every row: not one run
    assert strided.value(1, (0, [4, 2], [4, 1])) == 0.0
    with pytest.raises(Mixed):
        strided.value(1, (0, [1, 2], [4, 1]))  # inside, but not the same region: not told


def _recorded(program: Any) -> Recorder:
    """What the probe records of `program(param, placeholder)` on meta tensors."""
    param = torch.empty(2, 3, device="meta")
    source = torch.empty(2, 3, device="meta")
    keys = param.untyped_storage()._cdata, source.untyped_storage()._cdata
    recorder = Recorder({keys[0]: "p"}, {keys[1]: "w"}, {})
    with recorder:
        program(param, source)
    return recorder


def test_a_copy_of_a_checkpoint_tensor_zeroed_in_place_is_a_zero_fill() -> None:
    """vLLM's gpt-oss zeroes down_proj_bias on tp ranks > 0, then copies it."""

    def zero_then_copy(param: torch.Tensor, source: torch.Tensor) -> None:
        source.zero_()
        param.copy_(source)

    assert _recorded(zero_then_copy).ops == [["fill", "p", [0, [2, 3], [3, 1]], 0]]

    def zero_a_row_then_copy_it(param: torch.Tensor, source: torch.Tensor) -> None:
        source[1].zero_()
        param[0].copy_(source[0])
        param[1].copy_(source[1].clone())

    assert _recorded(zero_a_row_then_copy_it).ops == [
        ["copy", "p", [0, [3], [1]], "w", [0, [3], [1]], "F32"],
        ["fill", "p", [3, [3], [1]], 0],
    ]

    def zero_a_clone_then_copy_it(param: torch.Tensor, source: torch.Tensor) -> None:
        made = source.clone()
        made.zero_()
        param.copy_(made)

    assert _recorded(zero_a_clone_then_copy_it).ops == [["fill", "p", [0, [2, 3], [3, 1]], 0]]

    def zero_a_row_then_copy_across(param: torch.Tensor, source: torch.Tensor) -> None:
        source[1].zero_()
        param[:, :2].copy_(source[:, 1:])

    with pytest.raises(Refused, match="p: vLLM's load_weights copies into it a region of w"):
        _recorded(zero_a_row_then_copy_across)


def test_a_write_into_a_checkpoint_tensor_other_than_a_constant_is_refused() -> None:
    def add_into(param: torch.Tensor, source: torch.Tensor) -> None:
        source.copy_(param)

    with pytest.raises(Refused, match="writes into checkpoint tensor w"):
        _recorded(add_into)


def test_a_region_splits_into_equal_runs_in_its_own_order() -> None:
    # gpt-oss's gate_up_proj [2, 4, 6] cut to columns 2..5 and transposed: [2, 3, 4]
    region = (2, (2, 3, 4), (24, 1, 6))
    assert split_region(region, 2) == [(2, (3, 4), (1, 6)), (26, (3, 4), (1, 6))]
    assert split_region((0, (12,), (1,)), 3) == [(0, (4,), (1,)), (4, (4,), (1,)), (8, (4,), (1,))]
    assert split_region((0, (2, 3), (10, 1)), 4) is None  # 1.5 rows a part
    whole = (0, 24, ("w", (0, (24,), (1,))))
    halves = [(0, 12, ("w", (0, (12,), (1,)))), (12, 24, ("w", (12, (12,), (1,))))]
    assert per_expert(whole, (2, 12)) == halves
    assert per_expert((0, 24, zeros(24)), (2, 12)) == [(0, 12, zeros(12)), (12, 24, zeros(12))]
    assert per_expert((0, 6, zeros(6)), (2, 12)) == [(0, 6, zeros(6))]  # half an expert


def test_a_stack_filled_whole_transposed_and_a_bias_zero_on_rank_1_are_pieces_per_expert() -> None:
    """gpt-oss at tp 2 with 2 experts, hidden 3, intermediate 2: gate_up [2, 3, 4] gives
    w13 [2, 2, 3], the rank's columns transposed; down_proj_bias [2, 3] gives w2_bias
    [2, 3] whole on rank 0 and zeros on rank 1; gate_up_bias [2, 4] its columns."""
    sources = {"gu": ("F32", (2, 3, 4)), "db": ("F32", (2, 3)), "gb": ("F32", (2, 4))}
    params = {"w13": ["F32", [2, 2, 3]], "w2_bias": ["F32", [2, 3]], "w13_bias": ["F32", [2, 2]]}
    inference = Inference({}, sources, 2)
    for rank in (0, 1):
        bias = (
            ["copy", "w2_bias", [0, [2, 3], [3, 1]], "db", [0, [2, 3], [3, 1]], "F32"]
            if rank == 0
            else ["fill", "w2_bias", [0, [2, 3], [3, 1]], 0]
        )
        transposed = [2 * rank, [2, 2, 3], [12, 1, 4]]  # the rank's 2 columns of each expert
        ops = [
            ["copy", "w13", [0, [2, 2, 3], [6, 3, 1]], "gu", transposed, "F32"],
            ["copy", "w13_bias", [0, [2, 2], [2, 1]], "gb", [2 * rank, [2, 2], [4, 1]], "F32"],
            bias,
        ]
        inference.add(_record(rank, ops, params))
    layout = inference.layout()
    pieces = {param.name: param.pieces for param in layout.params}
    assert pieces == {
        "w13": tuple(Piece("gu", Cut.EXPERT_COLS_T, expert=e) for e in (0, 1)),
        "w13_bias": tuple(Piece("gb", Cut.EXPERT_ROW, expert=e) for e in (0, 1)),
        "w2_bias": tuple(Piece("db", Cut.EXPERT_ROW_FIRST, expert=e) for e in (0, 1)),
    }
    assert layout.num_experts == 2


def test_an_expert_of_zeros_alone_on_the_first_rank_read_is_refused_naming_it() -> None:
    inference = Inference({}, {"db": ("F32", (2, 3))}, 2)
    ops = [["fill", "w2_bias", [0, [2, 3], [3, 1]], 0]]
    with pytest.raises(PlanError, match="fills expert 0 of w2_bias with zeros alone on rank"):
        inference.add(_record(1, ops, {"w2_bias": ["F32", [2, 3]]}))


def test_mxfp4_blocks_and_biases_are_read_in_the_scheme_s_own_cuts() -> None:
    """gpt-oss in MXFP4 at tp 2, 2 experts, hidden 32, intermediate 64 (a 32-block a
    rank): vLLM copies each rank's gate/up rows of the blocks [2, 128, 1, 16] into w13
    [2, 64, 16] in one write, and down_proj_bias whole on rank 0, zeros on rank 1, into a
    bfloat16 w2_bias: the scheme's MX cuts are the ones that give those regions."""
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    blocks, bias = "gate_up_proj_blocks", "down_proj_bias"
    inference = Inference(config, {blocks: ("U8", (2, 128, 1, 16)), bias: ("BF16", (2, 32))}, 2)
    params = {"w13": ["U8", [2, 64, 16]], "w2_bias": ["BF16", [2, 32]]}
    for rank in (0, 1):
        rows = [
            "copy",
            "w13",
            [0, [2, 64, 16], [1024, 16, 1]],
            blocks,
            [rank * 1024, [2, 64, 16], [2048, 16, 1]],
            "U8",
        ]
        whole = [0, [2, 32], [32, 1]]
        bias_op = (
            ["copy", "w2_bias", whole, bias, whole, "BF16"]
            if rank == 0
            else ["fill", "w2_bias", whole, 0]
        )
        inference.add({**_record(rank, [rows, bias_op], params), "model_dtype": "BF16"})
    layout = inference.layout()
    w13_of = ScaleOf((128, 32), Cut.ROWS, (1, 2))
    bias_of = ScaleOf((1, 32), Cut.ROWS, (1, 1))
    assert {param.name: (param.pieces, param.dtype) for param in layout.params} == {
        "w13": (tuple(Piece(blocks, Cut.MX_W13, expert=e, scale_of=w13_of) for e in (0, 1)), "U8"),
        "w2_bias": (
            tuple(Piece(bias, Cut.MX_W2_BIAS, expert=e, scale_of=bias_of) for e in (0, 1)),
            "BF16",
        ),
    }
