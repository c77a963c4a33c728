"""compressed-tensors NVFP4 (`nvfp4-pack-quantized`) on linear layers in a real vLLM (CPU
build), as llm-compressor's `-NVFP4` and `-NVFP4A16` checkpoints quantize them: every
linear layer but `lm_head` (and the MoE routers), random weights really encoded.

vLLM's CPU build registers no NVFP4 linear kernel; the test-only plugin stands in for the
kernel choice alone (`SHARDPREP_STUB_KERNELS`): vLLM's own emulation kernel, which it
registers for CUDA and ROCm only and which is plain torch off CUDA (NVFP4A16: the same
weight decoding, then an ordinary linear layer). The layers, parameters and weight loaders
are vLLM's.

- Qwen3 (dense) W4A4 at tp2 x pp2: every rank file equals vLLM's state after
  `load_weights` byte for byte (`qkv_proj` holds three weight and three input global
  scales, `gate_up_proj` two, on every rank), and `sharded-fast` with every collective
  refused generates the default loader's greedy tokens and leaves the same state.
- Qwen3-MoE W4A4 at tp2: attention and routed experts in NVFP4, the routers in the
  ignore list; the experts cannot compute here, so the state after `load_weights` is the
  reference: every rank file equals it and `sharded-fast` leaves the same.
- Llama NVFP4A16 at tp2: no input global scales; rank files, tokens and state as above.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import (
    STATE_ONLY,
    TRAP,
    assert_generates_like_the_default_loader,
    assert_same_dumps,
    assert_same_state,
    from_checkpoint,
    rank_dumps,
)
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_NVFP4, TINY_NVFP4A16, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]


def test_qwen3_nvfp4_linear_layers_generate_the_default_loaders_tokens_at_tp2_pp2(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(
        tmp_path / "model", "Qwen3ForCausalLM", quantization_config=TINY_NVFP4,
        num_hidden_layers=2,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    assert read_manifest(artifact).vllm_layout.revisions["nvfp4_pack"] == 1
    states = assert_generates_like_the_default_loader(model, artifact, tmp_path, 2, 2)
    source = load_file(model / "model.safetensors")
    attention = "model.layers.1.self_attn."
    state = states[("target", 1, 1)]
    for scale in ("weight_global_scale", "input_global_scale"):  # q's, k's, v's, whole
        parts = [source[f"{attention}{p}_proj.{scale}"] for p in "qkv"]
        assert torch.equal(state[f"{attention}qkv_proj.{scale}"], torch.cat(parts))
    # o_proj is row-parallel: rank 1 holds the second half of its packed columns
    packed = source[f"{attention}o_proj.weight_packed"]
    half = packed.shape[1] // 2
    assert torch.equal(state[f"{attention}o_proj.weight_packed"], packed[:, half:])


def test_qwen3_moe_nvfp4_attention_and_experts_equal_vllm_state_at_tp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "Qwen3MoeForCausalLM", quantization_config=TINY_NVFP4,
        num_hidden_layers=2, moe_intermediate_size=96,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    run = {"dtype": "bfloat16", "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 1, tmp_path / "default", env=STATE_ONLY, **run)
    stack = "model.layers.1.mlp.experts.routed_experts."
    for rank in rank_dumps(dumps, artifact, tp=2, pp=1):
        state = from_checkpoint(rank.state)
        assert tuple(state[stack + "w13_weight_packed"].shape) == (8, 2 * 48, 128 // 2)
        assert tuple(state[stack + "w2_weight_scale"].shape) == (8, 128, 48 // 16)
        assert state["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # ignored
        assert tuple(state["model.layers.1.self_attn.qkv_proj.weight_global_scale"].shape) == (3,)
        assert_same_state(state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 1, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)


def test_llama_nvfp4a16_generates_the_default_loaders_tokens_at_tp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "LlamaForCausalLM", quantization_config=TINY_NVFP4A16,
        num_hidden_layers=2,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    states = assert_generates_like_the_default_loader(model, artifact, tmp_path, 2, 1)
    for state in states.values():
        assert not any(name.endswith("input_global_scale") for name in state)
        assert tuple(state["model.layers.0.mlp.gate_up_proj.weight_global_scale"].shape) == (2,)
