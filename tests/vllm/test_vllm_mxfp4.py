"""MXFP4 gpt-oss (`quant_method: mxfp4`) in a real vLLM (CPU build), at tp2 x pp2.

The tiny gpt-oss of the bfloat16 test with its experts in MXFP4 (random weights encoded
as OCP MXFP4 by `demo.fp4.mxfp4_encode`: `*_blocks` two e2m1 codes to a byte, `*_scales`
e8m0 exponents) and an intermediate size of 96: three
32-blocks, so vLLM's `_load_weights_mxfp4` gives tp rank 0 two of them and rank 1 one,
each copied into the corner of a parameter the MoE backend padded to 64 rows a rank.
vLLM's CPU build has no MXFP4 MoE kernel without AMX, so the test-only plugin stands in
for the backend choice alone (`SHARDPREP_STUB_KERNELS`: the CPU backend, which pads to
32); parameters and loaders stay vLLM's. The experts cannot compute here, so the run sets
`process_weights_after_loading` aside and the state after `load_weights` is the
reference: every rank file, converted with `--mxfp4-pad 32`, equals it byte for byte,
and `sharded-fast` (vLLM's quantization `gpt_oss_mxfp4`, every collective refused) leaves
the same state.

compressed-tensors `mxfp4-pack-quantized` (Kimi-K3's routed experts) on a tiny DeepSeek-V3
at tp2: `CompressedTensorsW4A4Mxfp4MoEMethod` builds uint8 stacks without padding; every
rank file equals vLLM's state byte for byte.

compressed-tensors `nvfp4-pack-quantized` (W4A4) on a tiny DeepSeek-V3 at tp2, with an
intermediate size of 96 (three groups of 16 a rank): random weights really encoded (e2m1
codes, e4m3 group scales, float32 global scales); `CompressedTensorsW4A4Nvfp4MoEMethod`
stacks the global scales as [E, 2] (gate, up) and [E] on every rank. The CPU build has no
NVFP4 MoE backend: the plugin stands in for `select_nvfp4_moe_backend` where it raises.
Every rank file equals vLLM's state byte for byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import (
    STATE_ONLY,
    TRAP,
    assert_same_dumps,
    assert_same_state,
    from_checkpoint,
    rank_dumps,
)
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_MXFP4, TINY_MXFP4_PACK, TINY_NVFP4_PACK, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
EXPERTS = "mlp.experts.routed_experts."


def test_gpt_oss_mxfp4_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "GptOssForCausalLM", quantization_config=TINY_MXFP4,
        intermediate_size=96,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2, mxfp4_pad="32"), progress=False)
    experts = read_manifest(artifact).model("target").experts
    assert experts is not None and experts.assumptions["mxfp4_padding"] == "32"
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "default", env=STATE_ONLY, dtype="bfloat16",
        allow_engine_failure=True,
    )  # fmt: skip
    source = load_file(model / "model.safetensors")
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        (_, p, t), state = rank.key, rank.state
        assert rank.meta["model_class"] == "GptOssForCausalLM"
        prefix = f"model.layers.{2 * p}."
        blocks = source[f"{prefix}mlp.experts.gate_up_proj_blocks"].view(4, 192, 64)
        w13 = state[f"{prefix}{EXPERTS}w13_weight"]
        assert tuple(w13.shape) == (4, 128, 64)  # 2 x 64 padded rows
        rows = (0, 128) if t == 0 else (128, 192)  # rank 1: one 32-block, then zeros
        assert torch.equal(w13[:, : rows[1] - rows[0]], blocks[:, rows[0] : rows[1]])
        assert not w13[:, rows[1] - rows[0] :].any()
        assert_same_state(state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, dtype="bfloat16", allow_engine_failure=True,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)


def test_deepseek_v3_mxfp4_pack_quantized_experts_equal_vllm_state_at_tp2(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(
        tmp_path / "model", "DeepseekV3ForCausalLM", num_hidden_layers=2,
        moe_intermediate_size=128, hidden_size=256, quantization_config=TINY_MXFP4_PACK,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    assert read_manifest(artifact).vllm_layout.revisions["mxfp4_pack"] == 1
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "default", env=STATE_ONLY, dtype="bfloat16",
        allow_engine_failure=True,
    )  # fmt: skip
    stack = "model.layers.1.mlp.experts.routed_experts."
    for rank in rank_dumps(dumps, artifact, tp=2, pp=1):
        state = from_checkpoint(rank.state)
        assert tuple(state[stack + "w13_weight_packed"].shape) == (8, 2 * 64, 256 // 2)
        assert tuple(state[stack + "w2_weight_scale"].shape) == (8, 256, 64 // 32)
        assert_same_state(state, rank.ours)


def test_deepseek_v3_nvfp4_pack_quantized_experts_equal_vllm_state_at_tp2(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(
        tmp_path / "model", "DeepseekV3ForCausalLM", num_hidden_layers=2,
        moe_intermediate_size=96, hidden_size=256, quantization_config=TINY_NVFP4_PACK,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    assert read_manifest(artifact).vllm_layout.revisions["nvfp4_pack"] == 1
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "default", env=STATE_ONLY, dtype="bfloat16",
        allow_engine_failure=True,
    )  # fmt: skip
    source = load_file(model / "model.safetensors")
    stack = "model.layers.1.mlp.experts.routed_experts."
    for rank in rank_dumps(dumps, artifact, tp=2, pp=1):
        state = from_checkpoint(rank.state)
        assert tuple(state[stack + "w13_weight_packed"].shape) == (8, 2 * 48, 256 // 2)
        assert state[stack + "w2_weight_scale"].dtype == torch.float8_e4m3fn
        assert tuple(state[stack + "w2_weight_scale"].shape) == (8, 256, 48 // 16)
        expert = "model.layers.1.mlp.experts.3."
        assert torch.equal(  # gate's, then up's, on every rank
            state[stack + "w13_weight_global_scale"][3],
            torch.cat([source[expert + f"{p}_proj.weight_global_scale"] for p in ("gate", "up")]),
        )
        assert tuple(state[stack + "w2_input_global_scale"].shape) == (8,)
        assert_same_state(state, rank.ours)
