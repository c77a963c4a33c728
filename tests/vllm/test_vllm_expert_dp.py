"""Expert parallelism over tp x dp in a real vLLM (CPU build, `--data-parallel-size 2`):
each worker's state right after loading equals its rank files plus its dp rank's expert
files, byte for byte, for the default loader and for `sharded-fast` (collectives
trapped). vLLM refuses data parallelism in the offline `LLM`, so the OpenAI server runs;
its first request then kills the engine (EP fails on the CPU build after loading, as at
dp 1), after every rank has loaded and dumped its state.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import vllm_env
from canary import TRAP, assert_same_state
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]

TP, DP = 2, 2
ENGINE = {"data_parallel_size": DP, "enable_expert_parallel": True}
# One core per worker, each dp rank's engine taking its own slice of the list.
BINDING = {"VLLM_CPU_OMP_THREADS_BIND": vllm_env.thread_binding(TP * DP) or ""}
DUMP_NAME = re.compile(r"target-pp0-tp(\d+)-dp(\d+)\.safetensors")


def dp_dumps(model: Path, dump_dir: Path, load_format: str, env: dict[str, str]) -> dict:
    """{(tp rank, dp rank): dump} of one vLLM server run over tp2 x dp2."""
    vllm_env.clear_dumps(dump_dir)
    expected = [(t, d) for t in range(TP) for d in range(DP)]
    vllm_env.run_until(
        lambda: sorted(found_dumps(dump_dir)) == expected, model, TP, 1, load_format,
        server=True, engine=ENGINE, dump_dir=dump_dir, max_tokens=1, prompts=[[1, 2, 3]],
        env=BINDING | env, timeout=420,
    )  # fmt: skip
    found = found_dumps(dump_dir)
    assert sorted(found) == expected, sorted(found)
    return found


def found_dumps(dump_dir: Path) -> dict[tuple[int, int], Path]:
    found = {}
    for path in sorted(dump_dir.glob("*.safetensors")):
        match = DUMP_NAME.fullmatch(path.name)
        assert match, path.name
        found[(int(match[1]), int(match[2]))] = path
    return found


def worker_files(artifact: Path, tp: int, dp: int) -> dict[str, torch.Tensor]:
    """What the manifest gives worker (tp, dp): its rank files, then its dp rank's experts."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in read_manifest(artifact).rank_files("target", 0, tp, dp):
        part = load_file(artifact / entry.path)
        assert not set(part) & set(tensors), "a parameter appears in two files"
        tensors.update(part)
    return tensors


def test_expert_parallel_over_tp_and_dp(tiny, tmp_path: Path) -> None:
    """Seven experts over EP 4 (ep rank = dp rank x 2 + tp rank: 2, 2, 2, 1 experts)."""
    model = tiny.model(
        "vllm-qwen3-moe-7", "Qwen3MoeForCausalLM",
        num_hidden_layers=5, mlp_only_layers=[0, 3], num_experts=7,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    options = Options(tp=TP, pp=1, dtype="float32", expert_parallel=True, dp=DP)
    convert(str(model), artifact, options, progress=False)
    default = dp_dumps(model, tmp_path / "default", "dump-default", {})
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    held = {}
    for (tp, dp), path in default.items():
        state, meta = vllm_env.read_dump(path)
        assert meta["tp_rank"] == tp
        held[dp * TP + tp] = state[w13].shape[0]
        assert_same_state(state, worker_files(artifact, tp, dp))
    assert held == {0: 2, 1: 2, 2: 2, 3: 1}
    fast = dp_dumps(artifact, tmp_path / "fast", "dump-sharded-fast", TRAP)
    for key, path in fast.items():
        (state, meta), (expected, _) = vllm_env.read_dump(path), vllm_env.read_dump(default[key])
        assert meta["trap_armed"] and meta["collectives_trapped"] > 30, meta
        assert meta["collective_calls"] == []
        assert_same_state(expected, state)
