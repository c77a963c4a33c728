"""vLLM's fp8 block-shape rules (`validate_fp8_block_shape`, the MoE refinement), on odd
sizes, without a model."""

from __future__ import annotations

import pytest

from shardprep.plan.quant.fp8 import (
    BlockQuant,
    LinearShape,
    block_problems,
    block_quant,
    moe_block_problems,
    refined_block,
)
from shardprep.plan.quant.fp8_tensor import TensorQuant

Q = BlockQuant((128, 128))


@pytest.mark.parametrize(
    ("layer", "refused"),
    [
        # replicated, one matrix: any size (its last block may be partial)
        (LinearShape.replicated("a", 200, (300,)), False),
        # replicated and merged: every matrix but the last in whole blocks
        (LinearShape.replicated("a", 128, (1536, 576)), False),
        (LinearShape.replicated("a", 128, (96, 576)), True),
        # column-parallel at tp3: 384 rows give 128 each; 192 give 64
        (LinearShape.column("q", 100, 384, 3), False),
        (LinearShape.column("q", 100, 192, 3), True),
        # merged column-parallel: each matrix's share
        (LinearShape.merged("gu", 128, (256, 256), 2), False),
        (LinearShape.merged("gu", 128, (384, 384), 2), True),
        # row-parallel: the input share; at tp1 nothing is checked
        (LinearShape.row("o", 384, 100, 3), False),
        (LinearShape.row("o", 192, 100, 3), True),
        (LinearShape.row("o", 192, 100, 1), False),
    ],
)
def test_linear_block_rules(layer: LinearShape, refused: bool) -> None:
    assert bool(block_problems([layer], Q)) is refused


@pytest.mark.parametrize(
    ("local", "hidden", "tp", "grid"),
    [
        (256, 7168, 8, None),  # whole blocks: nothing to refine
        (64, 7168, 2, (64, 64)),  # 128 rows in whole blocks, refined per rank
        (96, 128, 2, (32, 32)),  # 192 rows end in a partial block: vLLM cannot load
        (160, 128, 2, (32, 32)),
        (320, 128, 1, (64, 64)),  # tp1 with a partial block
        (80, 128, 4, None),  # gcd 16 < 32: no refinement, vLLM refuses
    ],
)
def test_moe_refinement(local: int, hidden: int, tp: int, grid: tuple[int, int] | None) -> None:
    """vLLM refines the blocks where it can, but its loader then places the upsampled
    scales only when the whole intermediate size is a number of whole blocks
    (`_load_w2` at 192 rows and tp2: size 3 vs 4)."""
    assert refined_block(Q, local, hidden, tp) == grid
    refused = moe_block_problems(Q, local, hidden, tp)
    assert bool(refused) is ((local * tp) % 128 != 0 if grid else local % 128 != 0)


def test_quantization_config() -> None:
    assert block_quant({}) is None
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert block_quant({"quantization_config": fp8}) == BlockQuant((128, 128))
    other = block_quant({"quantization_config": {"quant_method": "awq"}})
    assert other is not None and "quant_method 'awq'" in other.problem


@pytest.mark.parametrize(
    ("layer", "parts", "skipped"),
    [
        # one expert's projection listed: vLLM leaves the whole FusedMoE unquantized
        ("model.layers.1.mlp.experts", ("model.layers.1.mlp.experts.5.gate_proj",), True),
        ("model.layers.11.mlp.experts", ("model.layers.11.mlp.experts.3.down_proj",), False),
        # a shared expert's unfused projection: by substring, as vLLM matches it
        ("model.layers.2.mlp.shared_experts.down_proj",) * 2 + (True,),
        # its fused gate_up_proj: by the checkpoint names of its parts, exactly
        ("model.layers.2.mlp.shared_experts.gate_up_proj",
         ("model.layers.2.mlp.shared_experts.gate_proj",), False),
        ("model.layers.0.self_attn.qkv_proj", ("model.layers.0.self_attn.q_proj",), True),
        ("model.layers.0.self_attn.o_proj", ("model.layers.0.self_attn.o_proj",), False),
    ],
)  # fmt: skip
def test_modules_to_not_convert_match_as_vllm_matches_them(
    layer: str, parts: tuple[str, ...], skipped: bool
) -> None:
    listed = frozenset({
        "model.layers.1.mlp.experts.3.down_proj",
        "model.layers.2.mlp.shared_experts.down_proj",
        "model.layers.0.self_attn.q_proj",
    })  # fmt: skip
    assert BlockQuant(Q.block, ignored=listed).skips(layer, *parts) is skipped
    assert TensorQuant(ignored=listed).skips(layer, *parts) is skipped
