"""An fp8 block checkpoint of an architecture no family module names, converted with the
layout derived from vLLM (plan/derived), in a real vLLM (CPU build) with the test-only
plugin standing in for the kernel choice alone (see test_vllm_fp8.py): every rank file
equals the state vLLM's default loader leaves after `load_weights`, byte for byte, and
`sharded-fast` with every collective trapped leaves the same state; with the experts cut
over the ranks, and under expert parallelism (whole experts per rank). Qwen2-MoE
carries every kind of projection: attention, routed experts and a shared expert, each
with its block scales; its router and the shared expert's gate stay unquantized. Its MoE
layers cannot compute here, so the engine may fail after the state is dumped."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from artifacts import rank_tensors
from canary import (
    STATE_ONLY,
    TRAP,
    assert_same_dumps,
    assert_same_state,
    from_checkpoint,
    rank_dumps,
)
from derived_models import make_transformers_model, with_fp8_blocks

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
# Whole 128-blocks per rank at tp2: two heads of 128, the experts' 128 rows and columns.
WIDE = {
    "hidden_size": 256, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
}  # fmt: skip
EP = {"enable_expert_parallel": True}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-cut", "expert-parallel"])
def test_fp8_blocks_of_an_architecture_no_family_names_equal_vllm_at_tp2_pp2(
    expert_parallel: bool, tmp_path: Path
) -> None:
    model = with_fp8_blocks(
        make_transformers_model(tmp_path / "model", "Qwen2MoeForCausalLM", **WIDE)
    )
    artifact = tmp_path / "artifact"
    options = Options(tp=2, pp=2, expert_parallel=expert_parallel)
    convert(str(model), artifact, options, progress=False)
    assert read_manifest(artifact).vllm_layout.revisions == {"derived": 1, "fp8_block": 1}
    run = {
        "dtype": "bfloat16",
        "allow_engine_failure": True,
        "engine": EP if expert_parallel else {},
    }
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "dump", env=STATE_ONLY, **run)
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 2, with_draft=False))
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        assert_same_state(from_checkpoint(rank.state), rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)
    ours = rank_tensors(artifact, "target", 1, 1)
    layer = "model.layers.3.mlp."
    experts = layer + "experts.routed_experts."
    assert str(ours[experts + "w13_weight"].dtype) == "torch.float8_e4m3fn"
    # [experts, 2 x 256 / 128 / tp, 256 / 128]; under EP two whole experts of the four
    shape = (2, 4, 2) if expert_parallel else (4, 2, 2)
    assert tuple(ours[experts + "w13_weight_scale_inv"].shape) == shape
    assert tuple(ours["model.layers.3.self_attn.qkv_proj.weight_scale_inv"].shape) == (3, 2)
    assert str(ours[layer + "shared_expert.gate_up_proj.weight"].dtype) == "torch.float8_e4m3fn"
    assert str(ours[layer + "shared_expert_gate.weight"].dtype) == "torch.bfloat16"
