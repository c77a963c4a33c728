"""DeepSeek-V2/V3 (MLA, a dense first layer, shared and routed experts) against a real vLLM
(CPU build):

- at tp2, V2 without `q_lora_rank`, in bfloat16: every rank file equals what vLLM's
  default loader leaves on that rank, byte for byte (V3 in bfloat16, with `q_lora_rank`
  and the float32 `e_score_correction_bias`, is checked the same way at tp2 x pp2 in
  `test_vllm_mtp.py`, with its MTP draft);
- V3 at tp2 x pp2, in float32: the same for every rank, then `sharded-fast` leaves the same
  state with every collective trapped during the load and generates the default loader's
  greedy tokens. Tokens are compared in float32 because in bfloat16 they are not a function
  of the weights alone here: two runs of vLLM's default loader on the same checkpoint, with
  byte-identical state after `process_weights_after_loading` on every rank, gave different
  greedy tokens for one of two prompts. float32 MLA needs the CPU_MLA attention backend
  (the AMX one takes bfloat16 only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import TRAP, assert_rank_files_equal_dumps, assert_same_dumps

from shardprep.convert.run import Options, convert

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
LAYERS = {"num_hidden_layers": 3}  # layer 0 dense; at pp2, layers 0-1 and 2
CPU_MLA = {"attention_config": {"backend": "CPU_MLA"}}


def converted(model: Path, out: Path, tp: int, pp: int, dtype: str = "auto") -> Path:
    convert(str(model), out, Options(tp=tp, pp=pp, dtype=dtype), progress=False)
    return out


def test_v2_rank_files_equal_vllm_state_at_tp2(tiny, tmp_path: Path) -> None:
    model = tiny.model(f"vllm-{V2}", V2, **LAYERS)
    artifact = converted(model, tmp_path / "artifact", 2, 1)
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "dump", dtype="bfloat16", allow_engine_failure=True
    )
    assert sorted(dumps) == [("target", 0, 0), ("target", 0, 1)]
    state, _ = vllm_env.read_dump(dumps[("target", 0, 0)])
    attention = "model.layers.0.self_attn."
    assert attention + "q_proj.weight" in state  # no q_lora_rank: no fused_qkv_a_proj
    assert attention + "fused_qkv_a_proj.weight" not in state
    assert_rank_files_equal_dumps(artifact, dumps)


def test_v3_mla_sharded_fast_equals_the_default_loader_at_tp2_pp2(tiny, tmp_path: Path) -> None:
    model = tiny.model(f"vllm-{V3}", V3, **LAYERS)
    artifact = converted(model, tmp_path / "artifact", 2, 2, dtype="float32")
    run = {"max_tokens": 6, "engine": CPU_MLA}
    default = vllm_env.generate(model, 2, 2, "dump-default", dump_dir=tmp_path / "default", **run)
    default_dumps = vllm_env.dump_files(tmp_path / "default")
    assert sorted(default_dumps) == [("target", p, t) for p in range(2) for t in range(2)]
    assert_rank_files_equal_dumps(artifact, default_dumps)
    fast = vllm_env.generate(
        artifact, 2, 2, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP, **run
    )
    assert all(len(seq) == 6 for seq in default)
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), default_dumps)
