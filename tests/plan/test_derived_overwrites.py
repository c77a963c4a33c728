"""What vLLM's state finally holds where its load_weights writes one region twice
(plan/derived/overwrites.py): the later write wins, the earlier one is no piece, and a
checkpoint tensor only overwritten writes read is left out saying so; what a
parameter's shape says of its pieces (plan/derived/shapes.py): experts stacked in its
rows, one value held 0-d. Records made by hand, in the form the probe writes them."""

from __future__ import annotations

from typing import Any

from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.derived.infer import Inference
from shardprep.plan.derived.overwrites import final_writes
from shardprep.plan.derived.shapes import one_value


def _copy(param: str, start: int, count: int, source: str) -> list[Any]:
    return ["copy", param, [start, [count], [1]], source, [0, [count], [1]], "F32"]


def test_a_write_later_writes_cover_together_is_dropped() -> None:
    ops = [
        _copy("p", 0, 4, "a"),
        _copy("q", 0, 4, "a2"),
        _copy("p", 0, 2, "b"),
        _copy("p", 2, 2, "c"),
    ]
    assert final_writes(ops) == (ops[1:], {"a": "p"})


def test_a_write_later_ones_cover_in_part_or_in_another_parameter_is_kept() -> None:
    ops = [_copy("p", 0, 4, "a"), _copy("p", 1, 2, "b"), _copy("q", 0, 4, "c")]
    assert final_writes(ops) == (ops, {})


def test_a_strided_later_write_covers_only_what_it_writes() -> None:
    # column 0 of a [2, 2] parameter: elements 0 and 2, not 1, which its span holds
    column = ["copy", "p", [0, [2], [2]], "col", [0, [2], [1]], "F32"]
    ops = [_copy("p", 1, 1, "one"), column]
    assert final_writes(ops) == (ops, {})


def test_a_tensor_a_kept_write_reads_is_not_left_out() -> None:
    ops = [_copy("p", 0, 1, "a"), _copy("p", 0, 1, "b"), _copy("q", 0, 1, "a")]
    assert final_writes(ops) == (ops[1:], {})


def _scalar(param: str, slot: int, source: str) -> list[Any]:
    return ["copy", param, [slot, [], []], source, [0, [], []], "F32"]


def test_the_last_of_an_experts_gate_and_up_scales_in_one_slot_is_its_piece() -> None:
    """FusedMoE's `w13_input_scale` [E]: an expert's gate scale, then its up scale, into
    the expert's one value."""
    parts = [f"e{e}.{part}.input_scale" for e in range(2) for part in ("gate", "up")]
    ops = [_scalar("w13_input_scale", int(name[1]), name) for name in parts]
    record = {"model_dtype": "BF16", "params": {"w13_input_scale": ["F32", [2]]}, "ops": ops}
    inference = Inference({}, {name: ("F32", ()) for name in parts}, 2)
    for t in range(2):
        inference.add({**record, "rank": [0, t]})
    layout = inference.layout()
    (param,) = layout.params
    assert [p.source for p in param.pieces] == ["e0.up.input_scale", "e1.up.input_scale"]
    assert layout.skipped == {
        f"e{e}.gate.input_scale": "vLLM's load_weights copies it into w13_input_scale, then "
        "overwrites that with a later write"
        for e in range(2)
    }


def test_a_vector_an_expert_in_the_rows_of_a_2d_parameter_is_an_experts_piece() -> None:
    """compressed-tensors' `w13_weight_shape` [E, 2], which vLLM's experts layer holds
    (the record's expert stacks): each expert's [N, K] in its row."""
    sources = {f"e{e}.weight_shape": ("I32", (2,)) for e in range(3)}
    ops = [_copy("w13_weight_shape", 2 * e, 2, f"e{e}.weight_shape") for e in range(3)]
    params = {"w13_weight_shape": ["BF16", [3, 2]]}
    record = {"model_dtype": "BF16", "params": params, "ops": ops, "expert_stacks": [*params]}
    inference = Inference({}, sources, 2)
    for t in range(2):
        inference.add({**record, "rank": [0, t]})
    layout = inference.layout()
    (param,) = layout.params
    assert param.pieces == tuple(
        Piece(f"e{e}.weight_shape", Cut.REPLICATE, expert=e) for e in range(3)
    )
    assert layout.num_experts == 3


def test_a_0d_parameter_holds_the_one_value_of_a_scalar_or_a_1_element_source() -> None:
    """A KV-cache scale: vLLM's `attn.k_scale` is 0-d, the checkpoint's a scalar or [1]."""
    assert one_value((), "k_scale", ()) == [Piece("k_scale", Cut.SCALAR)]
    assert one_value((), "k_proj.k_scale", (1,)) == [Piece("k_proj.k_scale", Cut.SCALAR)]
    assert one_value((1,), "k_scale", ()) == []
    assert one_value((), "two", (2,)) == []
