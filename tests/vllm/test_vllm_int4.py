"""compressed-tensors int4 (W4A16, `pack-quantized`) checkpoints in a real vLLM (CPU build).

A tiny DeepSeek-V3 in the Kimi-K2-Thinking layout (int4 routed experts in groups of 32,
everything else in the `ignore` list) with its MTP draft at tp2 x pp2. vLLM's CPU build
has no WNA16 MoE backend without AMX, so the test-only plugin stands in for the backend
choice alone (`SHARDPREP_STUB_KERNELS`, see tests/vllm_dump_plugin/.../kernels.py): the
parameters and the FusedMoE weight loader are vLLM's own, and the state after
`load_weights` is the reference. The experts cannot compute here, so the runs set
`process_weights_after_loading` aside (the engine then builds the draft too, and fails
later, after every rank is dumped).

One pair of runs proves, on every rank of the target and of the draft: each rank file
equals vLLM's own per-rank state byte for byte (packed int32 stacks of the rank's gate
rows then up rows, and of its packed K columns of down_proj; group scales cut the same
way; `w13_weight_shape`/`w2_weight_shape` holding every expert's whole [N, K] in the
model's dtype), and `sharded-fast` leaves the same state with every collective refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import (
    MTP,
    STATE_ONLY,
    TRAP,
    assert_same_dumps,
    assert_same_state,
    from_checkpoint,
    rank_dumps,
)

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_INT4, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
W13 = "model.layers.2.mlp.experts.routed_experts.w13_weight_"


def test_deepseek_v3_int4_experts_with_mtp_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model",
        "DeepseekV3ForCausalLM",
        num_hidden_layers=3,
        num_nextn_predict_layers=1,
        moe_intermediate_size=128,  # 64 rows a rank: two groups of 32
        quantization_config=TINY_INT4,
        hidden_size=256,
    )
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    manifest = read_manifest(artifact)
    draft = manifest.model("draft")
    assert draft is not None and draft.quantization == "compressed-tensors"
    run = {"dtype": "bfloat16", "speculative_config": MTP, "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=STATE_ONLY, **run)
    shared = set(draft.shared_with_target)  # vLLM gives the draft the target's lm_head later
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared=shared):
        ours = rank.ours
        if (rank.role, rank.pp) == ("target", 1):
            assert tuple(ours[W13 + "packed"].shape) == (8, 2 * 64, 256 // 8)
            assert tuple(ours[W13 + "scale"].shape) == (8, 2 * 64, 256 // 32)
            assert ours[W13 + "shape"].tolist() == [[128.0, 256.0]] * 8
        assert_same_state(from_checkpoint(rank.state), ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps, leave_out={key: shared for key in fast if key[0] == "draft"})
