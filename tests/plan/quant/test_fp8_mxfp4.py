"""DeepSeek-V4's published quantization (plan/quant/fp8_mxfp4.py): what a weight is stored
as, how each stored tensor becomes vLLM's parameters, and the casts that keep the bytes,
on odd sizes."""

from __future__ import annotations

import torch

from shardprep.format.dtypes import cast
from shardprep.plan.archs.deepseek_v4.quant import ROUTED
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant.fp8_mxfp4 import Fp8Mxfp4Quant

SCHEME = Fp8Mxfp4Quant((128, 128), experts_pattern=ROUTED)


def test_a_linear_weight_is_fp8_with_e8m0_block_scales_beside_it() -> None:
    stored = SCHEME.stored("layers.3.attn.wo_b.weight", (300, 200))
    assert stored == {
        "layers.3.attn.wo_b.weight": ((300, 200), "F8_E4M3"),
        "layers.3.attn.wo_b.scale": ((3, 2), "F8_E8M0"),  # partial blocks count
    }
    # the shared experts are linear layers, not routed experts
    shared = SCHEME.stored("layers.0.ffn.shared_experts.w1.weight", (96, 64))
    assert shared["layers.0.ffn.shared_experts.w1.scale"] == ((1, 1), "F8_E8M0")


def test_a_routed_expert_is_e2m1_pairs_with_a_scale_per_32() -> None:
    stored = SCHEME.stored("layers.0.ffn.experts.11.w2.weight", (96, 64))
    assert stored == {
        "layers.0.ffn.experts.11.w2.weight": ((96, 32), "I8"),
        "layers.0.ffn.experts.11.w2.scale": ((96, 2), "F8_E8M0"),
    }


def test_each_parameter_reads_the_checkpoints_scale_names() -> None:
    shapes = {"a.wq_a.weight": (96, 256), "a.wkv.weight": (512, 256)}
    pieces = tuple(Piece(n, Cut.REPLICATE) for n in shapes)
    (weight, scale), _ = SCHEME.params("a.fused.weight", pieces, shapes, 2, 2)
    assert (weight[0], weight[2]) == ("a.fused.weight", "F8_E4M3")
    assert scale[0] == "a.fused.weight_scale_inv" and scale[2] == "F8_E8M0"
    assert [p.source for p in scale[1]] == ["a.wq_a.scale", "a.wkv.scale"]
    assert {p.cut for p in scale[1]} == {Cut.BLOCK_SCALE}
    routed = "l.ffn.experts.0.w2.weight"
    pieces = (Piece(routed, Cut.COLS, expert=0),)
    (stack, scales), _ = SCHEME.params("w2_weight", pieces, {routed: (96, 64)}, 2, 2)
    assert (stack[0], [p.source for p in stack[1]], stack[2]) == ("w2_weight", [routed], "U8")
    assert (scales[0], scales[2]) == ("w2_weight_scale", "U8")
    assert [p.source for p in scales[1]] == ["l.ffn.experts.0.w2.scale"]


def test_e8m0_and_int8_become_uint8_with_their_bytes_and_floats_by_value() -> None:
    exponents = torch.tensor([0, 119, 127, 254], dtype=torch.uint8)
    assert torch.equal(cast(torch, exponents.view(torch.float8_e8m0fnu), torch.uint8), exponents)
    pairs = torch.tensor([-128, -1, 0, 127], dtype=torch.int8)
    assert cast(torch, pairs, torch.uint8).tolist() == [128, 255, 0, 127]
    halves = torch.tensor([0.5, -3.0], dtype=torch.bfloat16)
    assert cast(torch, halves, torch.float32).tolist() == [0.5, -3.0]


def test_a_scheme_told_its_experts_matches_them_at_any_layer_and_expert_number() -> None:
    """What a derived layout does: the experts' names it found become the pattern."""
    told = Fp8Mxfp4Quant((128, 128)).for_experts(
        ["layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.1.w2.weight"]
    )
    assert told.is_expert("layers.41.ffn.experts.255.w1.weight")
    assert not told.is_expert("layers.41.ffn.experts.255.w3.weight")  # not among those told
    assert not told.is_expert("layers.0.ffn.shared_experts.w1.weight")
    assert (
        not Fp8Mxfp4Quant((128, 128)).for_experts([]).is_expert("layers.0.ffn.experts.0.w1.weight")
    )


def test_an_experts_weight_shape_is_read_back_from_its_packed_bytes_and_scales() -> None:
    expert, scale = "layers.0.ffn.experts.3.w2.weight", "layers.0.ffn.experts.3.w2.scale"
    assert SCHEME.weight_shape(expert, {expert: (96, 32), scale: (96, 2)}) == (96, 64)
    assert SCHEME.weight_shape(expert, {expert: (96, 32), scale: (96, 3)}) is None  # not MXFP4
    linear = "layers.0.attn.wo_b.weight"
    assert SCHEME.weight_shape(linear, {linear: (300, 200)}) == (300, 200)
