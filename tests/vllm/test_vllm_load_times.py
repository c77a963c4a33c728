"""The benchmark's timing plugin (tests/vllm_dump_plugin, `$SHARDPREP_LOAD_TIMES`): in a
real vLLM, every rank of the default loader and of sharded-fast reports its
`load_weights` seconds, so that `scripts/bench_load.py --vllm` compares every rank of
both loaders timed the same way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import vllm_env

from shardprep.convert.run import Options, convert

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
timing = pytest.importorskip("shardprep_test_dump.timing", reason="needs the test plugin")

TP, PP = 2, 1
MODEL_CONFIG = {"hidden_size": 128, "head_dim": 32}


def load_times(model: Path, load_format: str, out: Path) -> list[dict]:
    plugin = str(vllm_env.REPO / "tests" / "vllm_dump_plugin")
    pythonpath = os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH")) if p)
    env = {timing.TIMES_ENV: str(out), "PYTHONPATH": pythonpath}
    vllm_env.generate(model, TP, PP, load_format, env=env, max_tokens=1, prompts=[[1, 2]])
    return timing.read_times(out)


@pytest.mark.slow
def test_every_rank_of_both_loaders_reports_its_load_time(tiny, tmp_path: Path) -> None:
    model = tiny.model("vllm-times-llama", **MODEL_CONFIG)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=TP, pp=PP, dtype="float32"), progress=False)
    ranks = {(pp, tp) for pp in range(PP) for tp in range(TP)}
    for folder, load_format, loader in [
        (model, "auto", "default"),
        (artifact, "sharded-fast", "sharded-fast"),
    ]:
        lines = load_times(folder, load_format, tmp_path / f"{loader}.jsonl")
        assert {line["loader"] for line in lines} == {loader}, lines
        assert {line["role"] for line in lines} == {"target"}, lines
        assert sorted((line["pp_rank"], line["tp_rank"]) for line in lines) == sorted(ranks)
        assert len({line["pid"] for line in lines}) == TP * PP, "one line per worker"
        assert all(0 < line["seconds"] < 600 for line in lines), lines
        assert all(0 < line["cpu_seconds"] < 600 for line in lines), lines
