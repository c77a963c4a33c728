"""DeepSeek-V3 (MLA with q_lora_rank, dense first layer, shared and routed experts)
against a real vLLM (CPU build, bfloat16): every rank file equals what vLLM's default
loader leaves on that rank, byte for byte, at tp2 x pp2. The generate call that serves
(greedy tokens) also dumps each rank's state right after loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from test_vllm_layout import assert_same_state, rank_tensors

from shardprep.convert import Options, convert
from shardprep.tiny import make_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

V3 = "DeepseekV3ForCausalLM"


def run(
    model: Path, tp: int, pp: int, dump: Path, load_format: str = vllm_env.DUMP_FORMAT, **kw
) -> tuple[list[list[int]], vllm_env.DumpFiles]:
    tokens = vllm_env.generate(
        model, tp, pp, load_format, dump_dir=dump, dtype="bfloat16", max_tokens=6, **kw
    )
    return tokens, vllm_env.dump_files(dump)


def converted(model: Path, tp: int, pp: int, out: Path) -> Path:
    convert(str(model), out, Options(tp=tp, pp=pp), progress=False)
    return out


def assert_rank_files_equal_dumps(
    artifact: Path, dumps: vllm_env.DumpFiles, tp: int, pp: int
) -> None:
    assert sorted(dumps) == [("target", p, t) for p in range(pp) for t in range(tp)]
    for (role, p, t), path in dumps.items():
        vllm_state, _ = vllm_env.read_dump(path)
        assert_same_state(vllm_state, rank_tensors(artifact, role, p, t))


def test_v3_mla_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", V3, num_hidden_layers=3)
    artifact = converted(model, 2, 2, tmp_path / "artifact")
    tokens, dumps = run(model, 2, 2, tmp_path / "dump")
    assert all(len(seq) == 6 for seq in tokens)
    assert_rank_files_equal_dumps(artifact, dumps, 2, 2)
