"""DeepSeek-V4 (`DeepseekV4ForCausalLM`) in a real vLLM (CPU build, `models/deepseek_v4/cpu/`).

One tiny bfloat16 checkpoint in the published native naming (`embed.weight`,
`layers.N.attn.*` with compressors and indexers, `layers.N.ffn.experts.E.w1`, `hc_*`,
`head.weight`): a hash-routed layer and layers of compress ratio 0, 4 and 128, at
tp2 x pp2. Every rank file equals vLLM's own per-rank state after `load_weights`, byte
for byte (the engine fails after loading at pp > 1 on the CPU build, which leaves that
state complete), and `sharded-fast`, with every collective refused while each rank
loads, leaves the same state. vLLM's CPU build has no DSpark nor MTP model for
DeepSeek-V4 (both classes raise when built), so the checkpoint's DSpark draft is left out
here (`--no-mtp`); tests/plan/archs/deepseek_v4/test_deepseek_v4_dspark.py and
scripts/gpu_check_deepseek_v4.py test it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from test_vllm_layout import assert_same_state, rank_tensors
from test_vllm_moe import TRAP, assert_same_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
V4 = "DeepseekV4ForCausalLM"


def test_deepseek_v4_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", V4)
    artifact = tmp_path / "artifact"
    # the target alone: the CPU build cannot build the DSpark draft the checkpoint carries
    convert(str(model), artifact, Options(tp=2, pp=2, mtp_draft=False), progress=False)
    run = {"dtype": "bfloat16", "allow_engine_failure": True}
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "default", **run)
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 2, with_draft=False))
    for (role, p, t), path in dumps.items():
        state, meta = vllm_env.read_dump(path)
        assert meta["model_class"] == V4
        # float32 hyper-connections on every stage; layers 0-1 on stage 0, 2-3 on stage 1
        assert state["model.hc_head_fn"].dtype == torch.float32
        assert ("lm_head.weight" in state) == (p == 1)
        if p == 0:  # the hash-routed layer 0 and layer 1 of compress ratio 4
            assert state["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int32
            assert tuple(state["model.layers.0.attn.attn_sink"].shape) == (2,)
            fused = state["model.layers.1.attn.indexer.compressor.fused_wkv_wgate.weight"]
            assert tuple(fused.shape) == (512, 256)
        else:  # layer 2 of compress ratio 128: a compressor without overlap, no indexer
            assert tuple(state["model.layers.2.attn.compressor.ape"].shape) == (128, 512)
            assert "model.layers.2.attn.indexer.wq_b.weight" not in state
        assert_same_state(state, rank_tensors(artifact, role, p, t))
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast", env=TRAP, **run
    )
    assert_same_dumps(fast, dumps)
