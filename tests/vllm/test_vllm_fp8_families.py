"""fp8 schemes of the families the first fp8 proofs left out, in a real vLLM (CPU build),
with the test-only plugin standing in for the kernel choice alone (see test_vllm_fp8.py):
each test is one run of vLLM's default loader, whose per-rank state after `load_weights`
every rank file, target and draft, must equal byte for byte. Their MoE layers cannot
compute here, so vLLM's post-processing is set aside and the engine may fail after the
state is dumped.

- GLM-4.5 with fp8 blocks and its MTP draft at tp2 x pp2: a dense first layer, shared
  experts, routed experts refined to 64 x 64 blocks, the float32 router left unquantized,
  and an ignore list that names a target layer and a layer of the MTP draft.
- Qwen3-Next with fp8 blocks and its MTP draft at tp2, as published: `in_proj_ba` in
  `modules_to_not_convert`, the DeltaNet's `in_proj_qkvz` and `out_proj`, the gated
  attention, the shared expert and the draft's `fc` quantized.
- DeepSeek-V3 with compressed-tensors fp8 blocks and its MTP draft at tp2 x pp2: MLA's
  replicated fused `fused_qkv_a_proj`, experts whose blocks are not refined.
- Mixtral with compressed-tensors fp8 per tensor (static activations) at tp2.
- Qwen3-MoE with fp8 per-tensor weight and static activation scales at tp2, one router
  quantized and one not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm_env
from artifacts import rank_tensors
from canary import MTP, STATE_ONLY, assert_same_state, from_checkpoint, rank_dumps, without
from safetensors.torch import load_file, save_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_FP8, TINY_FP8_CT, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
# Whole 128-blocks per rank at tp2: q 256, k and v 128 rows, o_proj 256 columns.
WIDE = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}


def ct(strategy: str, inputs: dict[str, Any], **weights: Any) -> dict[str, Any]:
    """TINY_FP8_CT with the weights' strategy and the activations changed."""
    group = dict(TINY_FP8_CT["config_groups"]["group_0"])
    group["weights"] = {**group["weights"], "strategy": strategy, **weights}
    group["input_activations"] = {**group["input_activations"], **inputs}
    return {**TINY_FP8_CT, "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def assert_every_rank_file_equal(artifact: Path, dumps: vllm_env.DumpFiles) -> None:
    """Every rank file equals vLLM's state, but for the KV-cache scales vLLM creates and
    leaves unloaded, and a draft's parameters that vLLM replaces with the target's."""
    manifest = read_manifest(artifact)
    shared = {m.role: set(m.shared_with_target) for m in manifest.models}
    for rank in rank_dumps(dumps, artifact):
        state = without(from_checkpoint(rank.state), shared.get(rank.role, ()))
        assert_same_state(state, rank.ours)


def dumped(model: Path, tp: int, pp: int, dump: Path, draft: bool) -> vllm_env.DumpFiles:
    run: dict[str, Any] = {"speculative_config": MTP} if draft else {}
    dumps = vllm_env.dump_state(
        model, tp, pp, dump, dtype="bfloat16", env=STATE_ONLY, allow_engine_failure=True, **run
    )
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(tp, pp, with_draft=draft))
    return dumps


def test_glm_fp8_blocks_with_the_mtp_draft_at_tp2_pp2(tmp_path: Path) -> None:
    ignored = ["lm_head", "model.layers.1.mlp.shared_experts.down_proj",
               "model.layers.3.self_attn.o_proj"]  # fmt: skip
    model = make_tiny_model(
        tmp_path / "model", "Glm4MoeForCausalLM", num_hidden_layers=3,
        num_nextn_predict_layers=1, intermediate_size=512, moe_intermediate_size=128,
        n_shared_experts=2, quantization_config=TINY_FP8 | {"modules_to_not_convert": ignored},
        **WIDE,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    dumps = dumped(model, 2, 2, tmp_path / "dump", draft=True)
    assert_every_rank_file_equal(artifact, dumps)
    first = rank_tensors(artifact, "target", 0, 1)
    assert str(first["model.layers.1.mlp.gate.weight"].dtype) == "torch.float32"
    down = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert str(first[down].dtype) == "torch.bfloat16"
    draft = rank_tensors(artifact, "draft", 1, 0)
    block = "model.layers.3.mtp_block."
    assert str(draft[block + "self_attn.qkv_proj.weight"].dtype) == "torch.float8_e4m3fn"
    assert str(draft[block + "self_attn.o_proj.weight"].dtype) == "torch.bfloat16"
    # [experts, 2 x 64 / 64, 256 / 64]: the scales on vLLM's refined 64 x 64 grid
    assert tuple(draft[block + "mlp.experts.routed_experts.w13_weight_scale_inv"].shape) == (
        8,
        2,
        4,
    )


def test_qwen3_next_fp8_blocks_with_the_mtp_draft_at_tp2(tmp_path: Path) -> None:
    ignored = [f"model.layers.{i}.linear_attn.in_proj_ba" for i in (0, 2)]
    model = make_tiny_model(
        tmp_path / "model", "Qwen3NextForCausalLM", moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        quantization_config=TINY_FP8 | {"modules_to_not_convert": ["lm_head", *ignored]},
        **WIDE,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    dumps = dumped(model, 2, 1, tmp_path / "dump", draft=True)
    assert_every_rank_file_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 0, 1)
    attn = "model.layers.0.linear_attn."
    assert str(ours[attn + "in_proj_qkvz.weight"].dtype) == "torch.float8_e4m3fn"
    assert str(ours[attn + "in_proj_ba.weight"].dtype) == "torch.bfloat16"
    assert str(ours[attn + "conv1d.weight"].dtype) == "torch.bfloat16"
    draft = rank_tensors(artifact, "draft", 0, 1)
    assert tuple(draft["model.fc.weight_scale_inv"].shape) == (1, 4)


def test_deepseek_v3_compressed_tensors_fp8_blocks_with_mtp_at_tp2_pp2(tmp_path: Path) -> None:
    quant = ct("block", {"strategy": "group", "group_size": 128}, block_structure=[128, 128])
    model = make_tiny_model(
        tmp_path / "model", "DeepseekV3ForCausalLM", num_hidden_layers=3,
        num_nextn_predict_layers=1, n_shared_experts=2, quantization_config=quant,
        hidden_size=256,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    dumps = dumped(model, 2, 2, tmp_path / "dump", draft=True)
    assert_every_rank_file_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 1, 0)
    experts = "model.layers.2.mlp.experts.routed_experts."
    assert tuple(ours[experts + "w13_weight_scale"].shape) == (8, 2, 2)  # 128-blocks
    assert str(ours["model.layers.2.self_attn.fused_qkv_a_proj.weight_scale"].dtype) == (
        "torch.float32"
    )


def test_mixtral_compressed_tensors_fp8_per_tensor_at_tp2(tmp_path: Path) -> None:
    """Per-tensor weights with static per-tensor activations (vLLM's fp8 MoE takes no
    other per-tensor form): one scale per part of a fused layer, expert stacks with
    [E, 2] and [E] weight scales and one input scale per expert."""
    quant = ct("tensor", {"strategy": "tensor", "dynamic": False})
    model = make_tiny_model(
        tmp_path / "model", "MixtralForCausalLM", num_hidden_layers=2, quantization_config=quant
    )
    # vLLM refuses experts whose gate (w1) and up (w3) input scales differ
    tensors = load_file(model / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".w1.input_scale")]:
        tensors[name] = tensors[name.replace(".w1.", ".w3.")].clone()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    dumps = dumped(model, 2, 1, tmp_path / "dump", draft=False)
    assert_every_rank_file_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 0, 1)
    experts = "model.layers.1.block_sparse_moe.experts.routed_experts."
    kinds = ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale")
    shapes = [tuple(ours[experts + kind].shape) for kind in kinds]
    assert shapes == [(8, 2), (8,), (8,), (8,)]
    assert tuple(ours["model.layers.1.self_attn.qkv_proj.weight_scale"].shape) == (3,)


def test_qwen3_moe_fp8_per_tensor_static_at_tp2(tmp_path: Path) -> None:
    """`quant_method: fp8` per tensor with static activation scales; the router of layer 1
    is an fp8 layer (not in `modules_to_not_convert`), that of layer 0 is not."""
    quant = PER_TENSOR | {"modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    model = make_tiny_model(
        tmp_path / "model", "Qwen3MoeForCausalLM", num_hidden_layers=2, quantization_config=quant
    )
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    dumps = dumped(model, 2, 1, tmp_path / "dump", draft=False)
    assert_every_rank_file_equal(artifact, dumps)
    ours = rank_tensors(artifact, "target", 0, 0)
    assert str(ours["model.layers.0.mlp.gate.weight"].dtype) == "torch.bfloat16"
    assert str(ours["model.layers.1.mlp.gate.weight"].dtype) == "torch.float8_e4m3fn"
    assert tuple(ours["model.layers.1.mlp.gate.input_scale"].shape) == (1,)
