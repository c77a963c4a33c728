"""Kimi-K3 (`KimiK3ForConditionalGeneration`) in a real vLLM (CPU build): bfloat16, and its
published MXFP4 routed experts.

One tiny checkpoint in the published naming (`language_model.model.layers.*`: KDA layers
1 and 3, MLA layers 2 and 4 with the output gate, a dense layer 0 and latent experts,
attention residuals; a two-block MoonViT-3D under `vision_tower.`, the projector's
`mm_projector.proj.0/2`), served with one image prompt allowed so that vLLM builds the
tower, prefix caching off and `VLLM_KIMI_K3_GEMM_AR=0`, at tp2 x pp2:

- every rank file equals what vLLM's default loader leaves in memory, byte for byte: the
  fused `in_proj_qkvgfab` (q, k, v, g rows of the rank, `f_a_proj` whole, `b_proj` rows,
  then zero rows up to a multiple of 16), the float32 `conv1d`, `dt_bias` and `A_log`,
  `fused_qkv_a_g_proj` (latents whole, gate rows), the expert stacks over the latent
  width, the vision tower split by tp on both stages;
- `sharded-fast`, with every collective refused while each rank loads, leaves the same
  state.

The same model with the published `quantization_config` (compressed-tensors
`mxfp4-pack-quantized`, `demo.quant_configs.KIMI_K3_MXFP4`): its routed experts stored as
`weight_packed`/`weight_scale`, everything else in bfloat16, as published. vLLM rewrites
the quantization to its MXFP4 interface for Kimi-K3: `Mxfp4MoEMethod` builds uint8
`w13_weight`, `w2_weight` and their `_scale` over the latent width, every linear layer (the
latent projections too) unquantized. The experts' sizes (256 intermediate rows, 128 a rank
at tp2; latent width 256) are ones no MXFP4 MoE backend pads. The CPU build has no such
backend: the test-only plugin stands in for the backend choice alone
(`SHARDPREP_STUB_KERNELS`: vLLM's emulation backend) and post-processing is set aside, so
the state after `load_weights` is the reference. At tp2 x pp2 every rank file equals it
byte for byte, and `sharded-fast` (collectives trapped), text only (`limit_mm_per_prompt`
0: vLLM leaves the tower and projector unbuilt, and their tensors are skipped), leaves
the same state but those.

vLLM's CPU build cannot run this model after loading (its MLA backend refuses the KV
cache block size the hybrid model aligns to), so every run stops once every rank has
dumped its state: no tokens are compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import STATE_ONLY, TRAP, assert_same_dumps, assert_same_state, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import KIMI_K3_MXFP4, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
KIMI = "KimiK3ForConditionalGeneration"
ENGINE = {
    "attention_config": {"backend": "CPU_MLA"},
    "limit_mm_per_prompt": {"image": 1},
    "enable_prefix_caching": False,
}
ENV = {"VLLM_KIMI_K3_GEMM_AR": "0"}
LAYERS = "language_model.model.layers."
VISION = ("vision_tower.", "mm_projector.")


def test_kimi_k3_rank_files_equal_vllm_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", KIMI, torch_dtype="bfloat16")
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    run = {"dtype": "bfloat16", "allow_engine_failure": True, "engine": ENGINE}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=ENV, **run)
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        state, p = rank.state, rank.pp
        assert rank.meta["model_class"] == KIMI
        kda = f"{LAYERS}{2 * p}.self_attn."  # layer 0 (stage 0) and 2 (stage 1) are KDA
        # q, k, v, g: 4 x 32 rows of the rank, f_a 16, b 2, then 14 zero rows (to 160).
        fused = state[kda + "in_proj_qkvgfab.weight"]
        assert tuple(fused.shape) == (160, 64)
        assert not fused[146:].any()
        for name in ("conv1d.weight", "dt_bias", "A_log"):
            assert state[kda + name].dtype == torch.float32
        mla = f"{LAYERS}{2 * p + 1}.self_attn."
        # q_a 32 and kv_a 48 whole, the gate's 32 rows of the rank.
        assert tuple(state[mla + "fused_qkv_a_g_proj.weight"].shape) == (112, 64)
        moe = f"{LAYERS}{2 * p + 1}.block_sparse_moe."
        assert tuple(state[moe + "experts.routed_experts.w13_weight"].shape) == (8, 32, 32)
        assert state[moe + "gate.e_score_correction_bias"].dtype == torch.float32
        assert tuple(state["vision_tower.encoder.blocks.1.wqkv.weight"].shape) == (144, 64)
        assert ("language_model.model.embed_tokens.weight" in state) == (p == 0)
        assert ("language_model.lm_head.weight" in state) == (p == 1)
        assert_same_state(state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=ENV | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)


def test_kimi_k3_mxfp4_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", KIMI, torch_dtype="bfloat16", quantization_config=KIMI_K3_MXFP4,
        moe_intermediate_size=256, routed_expert_hidden_size=256,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    assert read_manifest(artifact).vllm_layout.revisions["mxfp4_pack"] == 1
    run = {"dtype": "bfloat16", "allow_engine_failure": True, "engine": ENGINE}
    env = ENV | STATE_ONLY
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=env, **run)
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        state = rank.state
        moe = f"{LAYERS}{2 * rank.pp + 1}.block_sparse_moe."
        experts = moe + "experts.routed_experts."
        # gate then up: 128 rows each on the rank, over the latent width 256 (128 bytes).
        assert state[experts + "w13_weight"].dtype == torch.uint8
        assert tuple(state[experts + "w13_weight"].shape) == (8, 256, 128)
        assert tuple(state[experts + "w2_weight_scale"].shape) == (8, 256, 128 // 32)
        down = state[moe + "routed_expert_down_proj.weight"]
        assert (down.dtype, tuple(down.shape)) == (torch.bfloat16, (256, 64))
        assert_same_state(state, rank.ours)
    # Text only: vLLM leaves the tower and projector unbuilt, and sharded-fast skips them.
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast", env=env | TRAP,
        **run | {"engine": ENGINE | {"limit_mm_per_prompt": {"image": 0}}},
    )  # fmt: skip
    vision = {}
    for key, path in dumps.items():
        vision[key] = {n for n in vllm_env.read_dump(path)[0] if n.startswith(VISION)}
        assert vision[key] and not vision[key] & set(vllm_env.read_dump(fast[key])[0])
    assert_same_dumps(fast, dumps, leave_out=vision)
