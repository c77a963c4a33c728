"""A vLLM worker on a Hub repo id of a mixture-of-experts artifact, at another topology,
downloads only the files it reads: the tp ranks its rank is made of and those that hold
its experts as vLLM spreads them (`worker_expert_ranks`), through the test Hub with the
real huggingface_hub client; what it downloaded is enough to cut its rank, byte for byte
what a conversion made at that topology holds. No engine: the worker's expert split is
given as vLLM's would be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hub_server import HubServer
from huggingface_hub import constants

from shardprep.constants import MANIFEST_NAME
from shardprep.convert.run import Options, convert
from shardprep.format.manifest import ModelEntry, read_manifest
from shardprep.hub.cache import ensure_rank
from shardprep.hub.cache_parts import RunningSplit
from shardprep.hub.publish import publish
from shardprep.loader.reader import read_rank
from shardprep.loader.regroup import ReadCount, regroup_rank
from shardprep.plan.regions import worker_stages
from shardprep.plan.topology import ExpertSplit

pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/TinyMoE-TP4-PP2"


def _split(tp: int, rank: int, expert_parallel: bool = False) -> RunningSplit:
    """vLLM's split of the experts on tp rank `rank` of `tp` (one dp rank)."""

    def running(entry: ModelEntry) -> tuple[ExpertSplit, int]:
        assert entry.experts is not None
        return ExpertSplit(entry.experts.num_experts, tp, 1, expert_parallel), rank

    return running


def test_a_worker_downloads_the_ranks_that_hold_what_it_reads(
    hub: HubServer, tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp4 x pp2 artifact, experts cut tp-wise. vLLM at tp2 x pp2 without expert
    parallelism: rank 1 of stage 1 downloads ranks 2 and 3 of stage 1 only. With expert
    parallelism its rank 0 holds whole experts, cut over all four ranks: it downloads the
    rest of the stage. A worker that cannot say how vLLM spreads its experts downloads its
    whole stage, as before."""
    model = tiny.model("qwen3-moe-4", "Qwen3MoeForCausalLM", num_hidden_layers=4)
    artifact = tmp_path / "tp4-pp2"
    convert(str(model), artifact, Options(tp=4, pp=2), progress=False)
    publish(artifact, REPO, endpoint=hub.endpoint, progress=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    url = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url)
    manifest = read_manifest(artifact)
    extras = {e.path for e in manifest.side_files}

    def paths(stage: int, ranks: set[int]) -> set[str]:
        return {f.path for f in manifest.files if f.pp == stage and f.tp in ranks}

    def downloaded() -> set[str]:
        return set(hub.downloads_by_origin(REPO)[None]) - {MANIFEST_NAME} - extras

    folder = ensure_rank(
        REPO, "target", stage=1, tp=2, tp_rank=1, partition=(2, 2), experts=_split(2, 1)
    )
    assert downloaded() == paths(1, {2, 3})
    assert paths(1, {2, 3}) and not any((folder / p).exists() for p in paths(1, {0, 1}))
    reference = tmp_path / "tp2-pp2"
    convert(str(model), reference, Options(tp=2, pp=2), progress=False)
    want = dict(read_rank(reference, "target", 1, 1))
    cached = read_manifest(folder)
    count = ReadCount()
    got = dict(
        regroup_rank(
            folder, cached, cached.model("target"), sorted(want), tp=2, tp_rank=1,
            experts=_split(2, 1)(cached.model("target")), count=count,
            stages=worker_stages(cached.topology, (2, 2), 1),
        )
    )  # fmt: skip
    assert sorted(got) == sorted(want) and count.read == count.own
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name

    ensure_rank(REPO, "target", stage=1, tp=2, tp_rank=0, partition=(2, 2),
                experts=_split(2, 0, expert_parallel=True))  # fmt: skip
    assert downloaded() == paths(1, {0, 1, 2, 3})
    ensure_rank(REPO, "target", stage=0, tp=2, tp_rank=0, partition=(2, 2), experts=None)
    assert downloaded() == paths(0, {0, 1, 2, 3}) | paths(1, {0, 1, 2, 3})
    assert all(hub.downloads(REPO, p) == 1 for p in downloaded())
