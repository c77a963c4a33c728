"""The flagship-count tier: each published model of tests/data with its published counts
(layers, experts, heads, MTP layers, files) at tiny widths, converted at the topology it is
served with (Kimi-K3 and DeepSeek at tp8 x pp2), then verified, inspected, and started as
each of its vLLM workers would start (the manifest read, the rank's files checked against
it), and one worker of half the tp planned from the regions file. Tiny widths prove
nothing of layouts (the real-vLLM tests do); the counts prove that the manifest, its
reader and every start-up path hold at the size people run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flagship import FLAGSHIPS, flagship_config, write_checkpoint, write_draft

from shardprep.cli import main
from shardprep.format.manifest import rank_key, read_manifest, read_regions
from shardprep.loader.reader import check_rank_files
from shardprep.plan.regions import tp_ranks_for
from shardprep.plan.regroup import plan_regroup
from shardprep.plan.topology import ExpertSplit

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(FLAGSHIPS))
def test_a_published_model_at_its_served_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    _, files, (tp, pp) = FLAGSHIPS[name]
    config = flagship_config(name)
    source = write_checkpoint(tmp_path / "source", config, files)
    draft = write_draft(tmp_path / "draft", name, config)
    out = tmp_path / "out"
    options = ["--tp", str(tp), "--pp", str(pp), "--quiet"]
    if draft is not None:
        options += ["--draft", str(draft), "--draft-method", "dspark"]
    assert main(["convert", str(source), "-o", str(out), *options]) == 0
    assert main(["verify", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = read_manifest(out)
    assert summary["topology"]["tp"] == tp and manifest.served_tps[-1] == tp
    if draft is not None:  # the seed's shape: the draft on the last stage only
        entry = manifest.model("draft")
        assert entry is not None and entry.method == "dspark"
        assert {f.pp for f in manifest.files if f.role == "draft"} == {pp - 1}
    for entry in manifest.models:  # every worker of every model starts
        for stage in manifest.stages if entry.role == "target" else (pp - 1,):
            for rank in range(tp):
                checked = check_rank_files(out, manifest, entry.role, stage, rank, verify=False)
                held = {n for f in checked for n in f.header.tensors}
                assert held == set(entry.rank_params(stage, rank))
    _half_tp_worker_plans(out, tp // 2, pp - 1)


def _half_tp_worker_plans(out: Path, tp: int, stage: int) -> None:
    """The last stage's first rank at half the tp: every parameter it holds made of the
    two artifact ranks it is made of, read once each."""
    manifest = read_regions(out, read_manifest(out))
    for entry in manifest.models:
        made = tp_ranks_for(manifest.topology.tp, tp, 0)
        wanted = sorted({n for t in made for n in entry.ranks.get(rank_key(stage, t), {})})
        experts = None
        if entry.experts is not None:
            experts = (ExpertSplit(entry.experts.num_experts, tp), 0)
        planned = list(
            plan_regroup(out, manifest, entry, wanted, tp=tp, tp_rank=0, experts=experts,
                         stages=(stage,))
        )  # fmt: skip
        assert [p.name for p in planned] == wanted
        holders = {r.holder for p in planned for r in p.reads}
        assert holders <= {rank_key(stage, t) for t in made}
