"""fp8 block-quantized checkpoints in a real vLLM (CPU build).

vLLM's CPU build has no fp8 kernel without AMX, so the test-only plugin stands in for the
kernel choice alone (`SHARDPREP_STUB_KERNELS`, see tests/vllm_dump_plugin/.../kernels.py):
vLLM's fp8 parameters and weight loaders are its own, and the state after `load_weights`
is the reference. Its MoE layers cannot compute here, so those runs set
`process_weights_after_loading` aside (the engine then builds the draft too, and fails
later, after every rank is dumped).

- DeepSeek-V3 with its MTP draft at tp2 x pp2, routed experts whose per-rank size (64)
  makes vLLM refine the 128 x 128 blocks to 64 x 64 and upsample their scales: every rank
  file, target and draft, equals vLLM's own per-rank state byte for byte, and
  `sharded-fast` leaves the same state with every collective refused.
- Qwen3 (dense) at tp2 x pp2: the same, and with the dequantizing stand-in kernel
  `sharded-fast` generates the default loader's greedy tokens.
- Qwen3 (dense) with per-tensor scales and static activation scales at tp2 x pp2: the
  same, tokens included (vLLM's post-processing requantizes each fused layer to one scale).
- Qwen3-MoE at tp2, the router of layer 0 in `modules_to_not_convert` and that of layer 1
  not (vLLM then builds it as an fp8 layer): every rank file equals vLLM's state.

- Qwen3-MoE at tp2 with compressed-tensors fp8 per channel: every rank file equals
  vLLM's state, scales cut with their weights' rows, and `sharded-fast` leaves the same.

Every attention layer of an fp8 model also gets KV-cache scales (`attn.k_scale`, ...),
which vLLM creates but leaves at -1 for a checkpoint without them: the rank files hold
none, and `sharded-fast` leaves them as vLLM does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from artifacts import rank_tensors
from canary import (
    MTP,
    STATE_ONLY,
    STUB,
    TRAP,
    assert_same_dumps,
    assert_same_state,
    from_checkpoint,
    rank_dumps,
)
from safetensors.torch import load_file, save_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_FP8, TINY_FP8_CT, make_tiny_model
from shardprep.format.manifest import read_manifest
from shardprep.plan.quant import never_loaded

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
# Whole 128-blocks per rank at tp2 (q 256, k and v 128 rows, o_proj 256 columns).
QWEN3 = {"hidden_size": 256, "head_dim": 128, "intermediate_size": 512, "num_hidden_layers": 2}
HIDDEN = 256


def test_deepseek_v3_fp8_with_mtp_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model",
        "DeepseekV3ForCausalLM",
        num_hidden_layers=3,
        num_nextn_predict_layers=1,
        moe_intermediate_size=128,  # 64 per rank: vLLM refines the blocks to 64 x 64
        n_shared_experts=2,  # 256 rows, whole 128-blocks per rank
        quantization_config=TINY_FP8,
        hidden_size=HIDDEN,
    )
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    draft = read_manifest(artifact).model("draft")
    run = {"dtype": "bfloat16", "speculative_config": MTP, "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=STATE_ONLY, **run)
    shared = set(draft.shared_with_target)  # vLLM gives the draft the target's lm_head later
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared=shared):
        role, ours = rank.role, rank.ours
        if rank.pp == 1:
            w13 = "model.layers.2.mlp.experts.routed_experts.w13_weight_scale_inv"
            if role == "draft":
                w13 = w13.replace("layers.2.", "layers.3.mtp_block.")
            # [experts, 2 x 64 / 64, hidden / 64]: scales on the refined 64 x 64 grid
            assert tuple(ours[w13].shape) == (8, 2, HIDDEN // 64), w13
        assert_same_state(rank.state, ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps, leave_out={key: shared for key in fast if key[0] == "draft"})


def assert_rank_files_equal(artifact: Path, dumps: vllm_env.DumpFiles) -> None:
    """Every rank file equals vLLM's state, but for the KV-cache scales vLLM creates and
    leaves unloaded (those a checkpoint ships are in the rank files and compared)."""
    for rank in rank_dumps(dumps, artifact):
        state, ours = rank.state, rank.ours
        assert any(never_loaded(name) for name in state)
        kept = {name: value for name, value in state.items() if name in ours}
        assert_same_state(from_checkpoint(state) | kept, ours)


def test_qwen3_fp8_generates_the_default_loaders_tokens_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "Qwen3ForCausalLM", quantization_config=TINY_FP8, **QWEN3
    )
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    run = {"dtype": "bfloat16", "max_tokens": 6, "env": STUB}
    default = vllm_env.generate(model, 2, 2, "dump-default", dump_dir=tmp_path / "default", **run)
    dumps = vllm_env.dump_files(tmp_path / "default")
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 2, with_draft=False))
    assert_rank_files_equal(artifact, dumps)
    run["env"] = STUB | TRAP
    fast = vllm_env.generate(artifact, 2, 2, "dump-sharded-fast", dump_dir=tmp_path / "fast", **run)
    assert all(len(tokens) == 6 for tokens in default)
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), dumps)


def test_qwen3_fp8_per_tensor_generates_the_default_loaders_tokens_at_tp2_pp2(
    tmp_path: Path,
) -> None:
    """Per-tensor scales with static activation scales: a fused layer holds one scale of
    each kind per part on every rank (`PerTensorScaleParameter`); the KV-cache scales the
    checkpoint ships are loaded where vLLM's weight mapper puts them."""
    quant = {"quant_method": "fp8", "activation_scheme": "static"}
    model = make_tiny_model(
        tmp_path / "model", "Qwen3ForCausalLM", quantization_config=quant, num_hidden_layers=2
    )
    # KV-cache scales as AutoFP8 (layer 0) and ModelOpt (layer 1) name them
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.v_proj.v_scale"] = torch.tensor([0.5])
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    run = {"dtype": "bfloat16", "max_tokens": 6, "env": STUB}
    default = vllm_env.generate(model, 2, 2, "dump-default", dump_dir=tmp_path / "default", **run)
    dumps = vllm_env.dump_files(tmp_path / "default")
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 2, with_draft=False))
    assert_rank_files_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 1, 1)
    assert float(ours["model.layers.1.self_attn.attn.v_scale"]) == 0.5
    assert "model.layers.1.self_attn.attn.k_scale" not in ours  # vLLM leaves it at -1
    for layer, parts in (("self_attn.qkv_proj", 3), ("mlp.gate_up_proj", 2), ("mlp.down_proj", 1)):
        for kind in ("weight_scale", "input_scale"):
            assert tuple(ours[f"model.layers.1.{layer}.{kind}"].shape) == (parts,)
    run["env"] = STUB | TRAP
    fast = vllm_env.generate(artifact, 2, 2, "dump-sharded-fast", dump_dir=tmp_path / "fast", **run)
    assert all(len(tokens) == 6 for tokens in default)
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), dumps)


def test_qwen3_moe_fp8_router_rules_at_tp2(tmp_path: Path) -> None:
    quant = TINY_FP8 | {"modules_to_not_convert": ["model.layers.0.mlp.gate"]}
    model = make_tiny_model(
        tmp_path / "model", "Qwen3MoeForCausalLM", quantization_config=quant,
        moe_intermediate_size=256, **QWEN3,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "default", dtype="bfloat16", env=STATE_ONLY,
        allow_engine_failure=True,
    )  # fmt: skip
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 1, with_draft=False))
    assert_rank_files_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 0, 1)
    assert str(ours["model.layers.0.mlp.gate.weight"].dtype) == "torch.bfloat16"
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in ours
    assert str(ours["model.layers.1.mlp.gate.weight"].dtype) == "torch.float8_e4m3fn"
    assert "model.layers.1.mlp.gate.weight_scale_inv" in ours


def test_qwen3_moe_compressed_tensors_fp8_at_tp2(tmp_path: Path) -> None:
    """compressed-tensors `float-quantized` fp8 per output channel (llm-compressor's
    `-FP8-dynamic`), with the router of layer 1 left out of the ignore list: vLLM builds
    it as an fp8 layer too. `sharded-fast` leaves the same state, collectives refused
    (and the KV-cache scales and zero points vLLM creates, unloaded, as the default loader
    leaves them)."""
    quant = TINY_FP8_CT | {"ignore": ["lm_head", "model.layers.0.mlp.gate"]}
    model = make_tiny_model(
        tmp_path / "model", "Qwen3MoeForCausalLM", quantization_config=quant,
        moe_intermediate_size=96, num_hidden_layers=2,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "default", dtype="bfloat16", env=STATE_ONLY,
        allow_engine_failure=True,
    )  # fmt: skip
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 1, with_draft=False))
    assert_rank_files_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 0, 1)
    experts = "model.layers.1.mlp.experts.routed_experts."
    scale = ours[experts + "w13_weight_scale"]
    assert (str(scale.dtype), scale.shape[1:]) == ("torch.float32", (96, 1))
    hidden = ours[experts + "w2_weight"].shape[1]
    assert ours[experts + "w2_weight_scale"].shape[1:] == (hidden, 1)  # whole per expert
    assert str(ours["model.layers.0.mlp.gate.weight"].dtype) == "torch.bfloat16"
    assert "model.layers.0.mlp.gate.weight_scale" not in ours
    assert str(ours["model.layers.1.mlp.gate.weight"].dtype) == "torch.float8_e4m3fn"
    assert ours["model.layers.1.mlp.gate.weight_scale"].shape[1] == 1
    fast = vllm_env.dump_state(
        artifact, 2, 1, tmp_path / "fast", load_format="dump-sharded-fast", dtype="bfloat16",
        env=STATE_ONLY | TRAP, allow_engine_failure=True,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)
