"""DeepSeek-V4 as published (fp8 linear layers with e8m0 scales, fp4 routed experts) in a
real vLLM (CPU build, `models/deepseek_v4/cpu/`).

A tiny checkpoint in the published naming and quantization (`quantization_config` of
DeepSeek-V4-Flash, `expert_dtype: fp4`): the linear layers' weights float8_e4m3fn with
their block scales beside them as `x.scale` (F8_E8M0), the routed experts' weights e2m1
pairs in int8 with `x.scale` one e8m0 exponent per 32 values; compressors, the indexer's
`weights_proj`, the router, norms, embedding and head in bfloat16. vLLM loads it with
`DeepseekV4FP8Config`: float8_e8m0fnu `weight_scale_inv` of the fp8 layers, uint8 MXFP4
stacks (`Mxfp4MoEMethod`). The sizes (latent ranks 128, expert and shared intermediate
256, hidden 256) are ones vLLM's fp8 block checks accept at tp2 and no MXFP4 backend pads.
The CPU build has no fp8 linear kernel nor MXFP4 MoE backend to choose: the test plugin
stands in for the choice alone (`SHARDPREP_STUB_KERNELS`) and post-processing is set aside,
so that the state after `load_weights` is the reference. At tp2 x pp2, every rank file
equals vLLM's own state byte for byte, and `sharded-fast`, with every collective refused
while each rank loads, leaves the same state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import STATE_ONLY, TRAP, assert_same_dumps, assert_same_state, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import DEEPSEEK_V4_FP8, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
V4 = "DeepseekV4ForCausalLM"
SIZES = {"q_lora_rank": 128, "o_lora_rank": 128, "moe_intermediate_size": 256}


def test_deepseek_v4_fp8_fp4_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", V4, quantization_config=DEEPSEEK_V4_FP8, expert_dtype="fp4", **SIZES
    )
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2, mtp_draft=False), progress=False)
    manifest = read_manifest(artifact)
    assert manifest.model("target").quantization == "deepseek_v4_fp8"
    assert manifest.vllm_layout.revisions["fp8_e8m0_mxfp4"] == 1
    run = {"dtype": "bfloat16", "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=STATE_ONLY, **run)
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        state, p = rank.state, rank.pp
        assert rank.meta["model_class"] == V4
        a = f"model.layers.{2 * p + 1}.attn."  # layer 1 (ratio 4) and layer 3 (ratio 4)
        fused = state[a + "fused_wqa_wkv.weight"]
        assert (fused.dtype, tuple(fused.shape)) == (torch.float8_e4m3fn, (128 + 512, 256))
        scale = state[a + "fused_wqa_wkv.weight_scale_inv"]  # 1 + 4 blocks of rows, 2 of 256
        assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e8m0fnu, (5, 2))
        assert state[a + "wo_a.weight_scale_inv"].shape == (1, 8)  # 128 rows of 256 a rank
        assert state[a + "indexer.wq_b.weight_scale_inv"].dtype == torch.float8_e8m0fnu
        for plain in ("compressor.fused_wkv_wgate.weight", "indexer.weights_proj.weight"):
            assert state[a + plain].dtype == torch.bfloat16
        f = f"model.layers.{2 * p + 1}.ffn."
        assert state[f + "gate.weight"].dtype == torch.bfloat16
        experts = f + "experts.routed_experts."
        # gate then up: 128 rows each on the rank, two values a byte, a scale per 32
        assert state[experts + "w13_weight"].dtype == torch.uint8
        assert tuple(state[experts + "w13_weight"].shape) == (4, 256, 128)
        assert tuple(state[experts + "w2_weight_scale"].shape) == (4, 256, 128 // 32)
        down = state[f + "shared_experts.down_proj.weight_scale_inv"]
        assert (down.dtype, tuple(down.shape)) == (torch.float8_e8m0fnu, (2, 1))
        assert_same_state(state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)
