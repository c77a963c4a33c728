"""vLLM started on a Hub repo id with --load-format sharded-fast: each worker fetches only
the rank files it reads from the (test) Hub into the stage-sharded cache, under a lock, and
loads, at the artifact's own topology and at another one."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import TRAP, assert_same_state, rank_dumps
from hub_server import HubServer

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import read_manifest
from shardprep.hub.cache import repo_folder
from shardprep.hub.publish import publish

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/Tiny-TP2-PP2-zstd"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]


def test_vllm_serves_a_hub_repo_fetching_one_stage_per_worker(
    hub: HubServer, tmp_path: Path
) -> None:
    model = make_tiny_model(tmp_path / "model")
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2, dtype="float32"), progress=False)
    publish(artifact, REPO, compress="zstd", endpoint=hub.endpoint, progress=False)
    cache = tmp_path / "node-cache"
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "SHARDPREP_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "vllm-hf-home"),
    }
    tokens = vllm_env.generate(REPO, 2, 2, "sharded-fast", env=env, prompts=PROMPTS)
    assert tokens == vllm_env.transformers_greedy(model, PROMPTS, 8)

    manifest = read_manifest(artifact)
    for entry in manifest.files:  # four workers, two per stage: each file fetched once
        assert hub.downloads(REPO, entry.path + ".zst") == 1, entry.path
    (commit,) = [p for p in repo_folder(REPO, cache_dir=cache).iterdir() if len(p.name) == 40]
    for entry in manifest.files:
        assert (commit / entry.path).read_bytes() == (artifact / entry.path).read_bytes()


def test_vllm_serves_a_hub_repo_at_another_topology(hub: HubServer, tmp_path: Path) -> None:
    """One vLLM run: a tp2 x pp2 repo of a MoE (Qwen3-MoE, every layer sparse) served at
    tp2 x pp1. Worker tp r reads rank r of both artifact stages, its experts included (vLLM
    cuts each expert tp-wise, as the artifact does), and that is all it downloads; every
    rank, loaded with every collective trapped, holds what a conversion made at tp2 x pp1
    holds (the layout canary proves that equal to vLLM's default loader), and the tokens
    are transformers' greedy ones."""
    model = make_tiny_model(tmp_path / "model", "Qwen3MoeForCausalLM")
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2, dtype="float32"), progress=False)
    repo = "shardprep-test/TinyMoE-TP2-PP2"
    publish(artifact, repo, endpoint=hub.endpoint, progress=False)
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_OFFLINE": "0",
        "SHARDPREP_CACHE": str(tmp_path / "node-cache"),
        "HF_HOME": str(tmp_path / "vllm-hf-home"),
        **TRAP,
    }
    dumps = tmp_path / "dumps"
    tokens = vllm_env.generate(
        repo, 2, 1, "dump-sharded-fast", env=env, prompts=PROMPTS, dump_dir=dumps
    )
    assert tokens == vllm_env.transformers_greedy(model, PROMPTS, 8)

    files = read_manifest(artifact).files
    by_worker = hub.downloads_by_origin(repo)
    for rank in (0, 1):
        shards = [p for p in by_worker[f"target-pp0-tp{rank}"] if p.startswith("shards/")]
        assert sorted(shards) == sorted(f.path for f in files if f.tp == rank), rank
    assert all(hub.downloads(repo, f.path) == 1 for f in files)
    # Unlabelled: vLLM's own front end reading config.json and the like, never a rank file.
    assert set(by_worker) - {None} == {"target-pp0-tp0", "target-pp0-tp1"}
    assert not any(p.startswith("shards/") for p in by_worker.get(None, [])), by_worker[None]

    reference = tmp_path / "tp2-pp1"
    convert(str(model), reference, Options(tp=2, pp=1, dtype="float32"), progress=False)
    for rank in rank_dumps(vllm_env.dump_files(dumps), reference, tp=2, pp=1):
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == [], rank.meta
        assert_same_state(rank.ours, rank.state)
