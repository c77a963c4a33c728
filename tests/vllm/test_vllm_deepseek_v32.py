"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and its MTP draft in a real vLLM (CPU build).

The CPU build refuses to choose a backend for sparse attention, so the model cannot even
be built there; the test-only plugin names the CPU MLA backend instead
(`SHARDPREP_STUB_SPARSE_ATTENTION`, see tests/vllm_dump_plugin/.../sparse.py) and, as for
every fp8 model, stands in for the fp8 kernel choice (`SHARDPREP_STUB_KERNELS`). vLLM's
parameters and weight loaders stay its own, so the state after `load_weights` is the
reference; the engine cannot compute sparse attention and fails after loading, which
leaves that state complete (and `process_weights_after_loading` is set aside so that the
draft is built too).

One tiny fp8 block checkpoint as DeepSeek-V3.2 is published (an indexer in every layer:
`wq_b` and `wk` fp8 with block scales, `weights_proj` bfloat16, `k_norm` float32), with its
MTP layer, at tp2 x pp2: every rank file, target and draft, equals vLLM's own per-rank
state byte for byte (`wk` dequantized into `wk_weights_proj` as vLLM's `load_weights` does
it), and `sharded-fast`, with every collective refused while each rank loads, leaves the
same state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import MTP, TRAP, assert_same_dumps, assert_same_state, rank_dumps
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_FP8, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
STATE_ONLY = {
    "SHARDPREP_STUB_KERNELS": "1",
    "SHARDPREP_SKIP_POSTPROCESS": "1",
    "SHARDPREP_STUB_SPARSE_ATTENTION": "1",
}
LAYERS = 3  # the MTP layer is model.layers.3
IDX = "self_attn.indexer."


def test_deepseek_v32_fp8_with_mtp_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model",
        "DeepseekV32ForCausalLM",
        num_hidden_layers=LAYERS,
        num_nextn_predict_layers=1,
        moe_intermediate_size=128,  # 64 per rank: vLLM refines the blocks to 64 x 64
        n_shared_experts=2,  # 256 rows, whole 128-blocks per rank
        quantization_config=TINY_FP8,
        hidden_size=256,
    )
    stored = load_file(model / "model.safetensors")
    assert stored[f"model.layers.0.{IDX}wk.weight"].dtype == torch.float8_e4m3fn
    assert f"model.layers.{LAYERS}.{IDX}wk.weight_scale_inv" in stored
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    draft = read_manifest(artifact).model("draft")
    run = {"dtype": "bfloat16", "speculative_config": MTP, "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=STATE_ONLY, **run)
    shared = set(draft.shared_with_target)  # vLLM gives the draft the target's lm_head later
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared=shared):
        (role, p, _), state = rank.key, rank.state
        layer = f"model.layers.{LAYERS}.mtp_block." if role == "draft" else f"model.layers.{2 * p}."
        # Every layer's indexer: wq_b fp8 with its block scales, wk and weights_proj fused
        # in bfloat16, k_norm float32; whole on both tp ranks.
        assert state[layer + IDX + "wq_b.weight"].dtype == torch.float8_e4m3fn
        assert tuple(state[layer + IDX + "wq_b.weight_scale_inv"].shape) == (4, 1)
        assert tuple(state[layer + IDX + "wk_weights_proj.weight"].shape) == (128 + 4, 256)
        assert state[layer + IDX + "wk_weights_proj.weight"].dtype == torch.bfloat16
        assert state[layer + IDX + "k_norm.bias"].dtype == torch.float32
        if role == "draft":
            assert rank.meta["model_class"] == "DeepSeekMTP"
        assert_same_state(state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=STATE_ONLY | TRAP, **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps, leave_out={key: shared for key in fast if key[0] == "draft"})
