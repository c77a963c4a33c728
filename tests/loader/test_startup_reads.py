"""What a worker opens: at the artifact's own topology the manifest, parsed once for its
target and its draft, and its own rank files, nothing else (not the regions file); at a
coarser tp the regions file too, checked and parsed once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model

WORKER = """
import json, sys
from pathlib import Path
from shardprep.format import manifest as mf
from shardprep.format import regions
from shardprep.format.manifest import read_manifest
from shardprep.loader.reader import read_rank
from shardprep.loader.regroup import regroup_rank
from shardprep.plan.topology import ExpertSplit

artifact, pp, tp, tp_size = Path(sys.argv[1]), *map(int, sys.argv[2:5])
opened, parsed = [], []
sys.addaudithook(lambda event, args: event == "open" and opened.append(str(args[0])))
for module, name in ((mf, "parse_manifest"), (regions, "parse_regions")):
    original = getattr(module, name)
    def counted(*args, original=original, name=name, **kwargs):
        parsed.append(name)
        return original(*args, **kwargs)
    setattr(module, name, counted)
held = {}
for role in ("target", "draft"):
    manifest = read_manifest(artifact)
    if tp_size == manifest.topology.tp:
        tensors = dict(read_rank(artifact, role, pp, tp, manifest=manifest))
    else:
        entry = manifest.model(role)
        wanted = sorted({n for t in range(2) for n in entry.rank_params(pp, t)})
        experts = entry.experts and (ExpertSplit(entry.experts.num_experts, tp_size), tp)
        tensors = dict(regroup_rank(artifact, manifest, entry, wanted, tp=tp_size, tp_rank=tp,
                                    experts=experts, stages=(pp,)))
    held[role] = len(tensors)
root = str(artifact.resolve())
print(json.dumps({"opened": sorted({p for p in opened if p.startswith(root)}),
                  "parsed": parsed, "held": held}))
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup")
    model = make_tiny_model(root / "model", "Qwen3MoeForCausalLM", num_experts=8)
    draft = make_tiny_draft(root / "draft", model)
    convert(str(model), root / "out", Options(tp=2, pp=2, draft=str(draft)), progress=False)
    return (root / "out").resolve()


def _worker(artifact: Path, pp: int, tp: int, tp_size: int) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", WORKER, str(artifact), str(pp), str(tp), str(tp_size)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_a_worker_at_its_topology_opens_the_manifest_and_its_files_only(artifact: Path) -> None:
    found = _worker(artifact, 1, 1, 2)
    own = {
        f"{artifact}/shards/model-pp-1-tp-1-part-0.safetensors",
        f"{artifact}/draft/shards/model-pp-1-tp-1-part-0.safetensors",
    }
    assert set(found["opened"]) == {f"{artifact}/shardprep.json", *own}
    assert found["parsed"] == ["parse_manifest"]  # once for the target and the draft
    assert found["held"]["target"] > 0 and found["held"]["draft"] > 0


def test_a_worker_at_a_coarser_tp_reads_the_regions_file_once(artifact: Path) -> None:
    found = _worker(artifact, 1, 0, 1)
    assert f"{artifact}/shardprep.regions.json" in found["opened"]
    assert sorted(found["parsed"]) == ["parse_manifest", "parse_regions"]
    assert found["held"]["target"] > 0 and found["held"]["draft"] > 0
