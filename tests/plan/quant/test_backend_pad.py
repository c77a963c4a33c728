"""Where an unpadded expert stack goes in the parameter an MoE kernel backend padded
(plan/quant/backend_pad.py): the corner (gpt-oss's whole-stack loading) or the front of
each half of a gate/up stack (FusedMoE's `_load_w13`), on odd sizes, checked against the
same copies done by hand with torch."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardprep.format.records import _mx_nested
from shardprep.plan.layout import mx_range
from shardprep.plan.quant.backend_pad import (
    CORNER,
    GATE_UP,
    StackPad,
    pads_by_backend,
    placements,
    stack_pad,
)

ROUTED = "model.layers.3.mlp.experts.routed_experts."


def place(stored: torch.Tensor, built: tuple[int, ...], pad: StackPad) -> torch.Tensor:
    spans = placements(tuple(stored.shape), built, pad)
    assert spans is not None
    out = torch.zeros(built, dtype=stored.dtype)
    for dest, source in spans:
        out[tuple(slice(*d) for d in dest)] = stored[tuple(slice(*s) for s in source)]
    return out


# (experts, rows, columns) stored and built, including a rank that holds nothing (0 rows)
SHAPES = [((3, 10, 7), (3, 16, 9)), ((2, 6, 5), (2, 6, 8)), ((1, 0, 4), (1, 64, 4))]


@pytest.mark.parametrize(("stored", "built"), SHAPES)
def test_the_corner_keeps_every_index_and_zeros_the_rest(stored: tuple, built: tuple) -> None:
    values = torch.arange(1, 1 + torch.Size(stored).numel()).reshape(stored)
    out = place(values, built, CORNER)
    for index in itertools.product(*map(range, built)):
        inside = all(i < s for i, s in zip(index, stored, strict=True))
        assert out[index] == (values[index] if inside else 0)


@pytest.mark.parametrize(("stored", "built"), SHAPES)
def test_gate_up_halves_each_start_their_half(stored: tuple, built: tuple) -> None:
    """What `_load_w13` does with the rank's gate rows and its up rows: each narrowed to
    its half of the padded parameter, then to the rows and columns it has."""
    values = torch.arange(1, 1 + torch.Size(stored).numel()).reshape(stored)
    half, room = stored[1] // 2, built[1] // 2
    expected = torch.zeros(built, dtype=values.dtype)
    expected[:, :half, : stored[2]] = values[:, :half]
    expected[:, room : room + half, : stored[2]] = values[:, half:]
    assert torch.equal(place(values, built, GATE_UP), expected)


def test_a_vector_stack_pads_its_halves_too() -> None:
    bias = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert place(bias, (2, 8), GATE_UP).tolist() == [
        [1, 2, 0, 0, 3, 4, 0, 0],
        [5, 6, 0, 0, 7, 8, 0, 0],
    ]
    assert place(bias, (2, 6), CORNER).tolist() == [[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 0, 0]]


@pytest.mark.parametrize(
    ("stored", "built", "pad"),
    [
        ((3, 10, 7), (3, 8, 7), CORNER),  # longer than the parameter
        ((3, 10, 7), (3, 10), CORNER),  # another number of dimensions
        ((4, 10, 7), (3, 10, 7), CORNER),  # more experts
        ((3, 9, 7), (3, 16, 7), GATE_UP),  # halves of odd size
        ((3, 10, 7), (3, 15, 7), GATE_UP),
    ],
)
def test_what_does_not_fit_gets_no_placement(stored: tuple, built: tuple, pad: StackPad) -> None:
    assert placements(stored, built, pad) is None


def test_the_methods_and_stacks_the_backends_pad() -> None:
    assert stack_pad("gpt_oss_mxfp4", ROUTED + "w13_weight") == CORNER
    assert stack_pad("gpt_oss_mxfp4", ROUTED + "w2_bias") == CORNER
    for method in ("mxfp4", "deepseek_v4_fp8"):
        assert stack_pad(method, ROUTED + "w13_weight_scale") == GATE_UP
        assert stack_pad(method, ROUTED + "w2_weight") == CORNER
        assert stack_pad(method, "model.layers.3.self_attn.o_proj.weight") is None
        assert pads_by_backend(method)
    for method in (None, "fp8", "compressed-tensors"):
        assert stack_pad(method, ROUTED + "w13_weight") is None
        assert not pads_by_backend(method)


@pytest.mark.parametrize("tp", [2, 3, 4, 6, 8, 16])
def test_a_coarser_tp_is_served_where_its_mxfp4_ranks_are_unions_of_the_artifacts(
    tp: int,
) -> None:
    """vLLM gives each rank ceil(blocks / tp) 32-blocks: a coarser rank's rows are those of
    the artifact ranks it is made of (`tp_ranks_for`) only for some block counts; the
    manifest serves exactly those, as this enumeration of vLLM's split finds them."""
    for blocks in range(1, 100):
        inter = 32 * blocks
        for served in (d for d in range(1, tp + 1) if tp % d == 0):
            k = tp // served
            unions = all(
                mx_range(inter, served, r)
                == (mx_range(inter, tp, r * k)[0], mx_range(inter, tp, r * k + k - 1)[1])
                for r in range(served)
            )
            assert _mx_nested(blocks, tp, served) == unions, (blocks, tp, served)
    assert _mx_nested(90, 8, 1) and not _mx_nested(90, 8, 4)  # gpt-oss-120b at tp8
