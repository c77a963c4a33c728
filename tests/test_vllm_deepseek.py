"""DeepSeek-V2/V3 (MLA, a dense first layer, shared and routed experts) against a real vLLM
(CPU build, bfloat16, so the float32 `e_score_correction_bias` of a bfloat16 model is
checked too): every rank file equals what vLLM's default loader leaves on that rank, byte
for byte, for V2 without `q_lora_rank` and V3 with it at tp2, and V3 at tp2 x pp2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from test_vllm_moe import assert_rank_files_equal_dumps

from shardprep.convert import Options, convert

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
LAYERS = {"num_hidden_layers": 3}  # layer 0 dense; at pp2, layers 0-1 and 2


def converted(model: Path, out: Path, tp: int, pp: int, dtype: str = "auto") -> Path:
    convert(str(model), out, Options(tp=tp, pp=pp, dtype=dtype), progress=False)
    return out


@pytest.mark.parametrize("arch", [V2, V3], ids=["v2-without-q-lora", "v3-mla"])
def test_rank_files_equal_vllm_state_at_tp2(tiny, tmp_path: Path, arch: str) -> None:
    model = tiny.model(f"vllm-{arch}", arch, **LAYERS)
    artifact = converted(model, tmp_path / "artifact", 2, 1)
    dumps = vllm_env.dump_state(model, 2, 1, tmp_path / "dump", dtype="bfloat16")
    assert sorted(dumps) == [("target", 0, 0), ("target", 0, 1)]
    state, _ = vllm_env.read_dump(dumps[("target", 0, 0)])
    attention = "model.layers.0.self_attn."
    fused = attention + "fused_qkv_a_proj.weight"
    assert (fused in state, attention + "q_proj.weight" in state) == (arch == V3, arch == V2)
    if arch == V3:
        bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert (str(bias.dtype), str(state[fused].dtype)) == ("torch.float32", "torch.bfloat16")
    assert_rank_files_equal_dumps(artifact, dumps)


def test_v3_mla_rank_files_equal_vllm_state_at_tp2_pp2(tiny, tmp_path: Path) -> None:
    model = tiny.model(f"vllm-{V3}", V3, **LAYERS)
    artifact = converted(model, tmp_path / "artifact", 2, 2)
    dumps = vllm_env.dump_state(model, 2, 2, tmp_path / "dump", dtype="bfloat16")
    assert sorted(dumps) == [("target", p, t) for p in range(2) for t in range(2)]
    assert_rank_files_equal_dumps(artifact, dumps)
