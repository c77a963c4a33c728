"""vLLM started on a Hub repo id with --load-format sharded-fast: each worker fetches only
its own stage from the (test) Hub into the stage-sharded cache, under a lock, and loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
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
