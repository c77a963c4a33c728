"""ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`) in a real vLLM (CPU
build): every linear layer but `lm_head` (and the MoE routers) stored as packed e2m1
weights (uint8, under the weight's own name), e4m3 group scales and float32
`weight_scale_2` and `input_scale` scalars, random weights really encoded.

vLLM's CPU build registers no NVFP4 linear kernel or MoE backend; the test-only plugin
stands in for the kernel choice alone (vLLM's own emulation kernel for linear layers, its
emulation MoE backend class for the experts). vLLM's `ModelOptNvFp4Config` builds the
layers, parameters and weight loaders.

- Llama at tp2: every rank file equals vLLM's state after `load_weights` byte for byte
  (`qkv_proj` holds three `weight_scale_2` and three `input_scale` on every rank), and
  `sharded-fast` with every collective refused generates the default loader's greedy
  tokens and leaves the same state.
- Qwen3-MoE at tp2 x pp2: attention and routed experts (`w13_weight_scale_2` and
  `w13_input_scale` [E, 2], `w2_*` [E]); the experts cannot compute here, so the state
  after `load_weights` is the reference, and `sharded-fast` leaves the same.
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
from shardprep.demo.tiny import TINY_MODELOPT_NVFP4, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]


def test_llama_modelopt_nvfp4_generates_the_default_loaders_tokens_at_tp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "LlamaForCausalLM", quantization_config=TINY_MODELOPT_NVFP4,
        num_hidden_layers=2,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    entry = read_manifest(artifact).model("target")
    assert entry is not None and entry.quantization == "modelopt_fp4"
    states = assert_generates_like_the_default_loader(model, artifact, tmp_path, 2, 1)
    source = load_file(model / "model.safetensors")
    attention = "model.layers.1.self_attn."
    for (_, _, rank), state in states.items():
        for scale in ("weight_scale_2", "input_scale"):  # q's, k's, v's, on every rank
            parts = [source[f"{attention}{p}_proj.{scale}"].reshape(1) for p in "qkv"]
            assert torch.equal(state[f"{attention}qkv_proj.{scale}"], torch.cat(parts))
        packed = source[f"{attention}o_proj.weight"]  # row-parallel: packed columns split
        half = packed.shape[1] // 2
        assert torch.equal(
            state[f"{attention}o_proj.weight"], packed[:, rank * half : (rank + 1) * half]
        )


def test_qwen3_moe_modelopt_nvfp4_equals_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "Qwen3MoeForCausalLM", quantization_config=TINY_MODELOPT_NVFP4,
        num_hidden_layers=2,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    run = {"dtype": "bfloat16", "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=STATE_ONLY, **run)
    source = load_file(model / "model.safetensors")
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        state, p = from_checkpoint(rank.state), rank.pp
        stack = f"model.layers.{p}.mlp.experts.routed_experts."
        assert tuple(state[stack + "w13_weight"].shape) == (8, 2 * 32, 128 // 2)
        assert state[stack + "w13_weight"].dtype == torch.uint8
        expert = f"model.layers.{p}.mlp.experts.5."
        assert torch.equal(  # gate's, then up's, on every rank
            state[stack + "w13_input_scale"][5],
            torch.stack([source[expert + f"{j}_proj.input_scale"] for j in ("gate", "up")]),
        )
        assert state[f"model.layers.{p}.mlp.gate.weight"].dtype == torch.bfloat16  # excluded
        assert_same_state(state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)
