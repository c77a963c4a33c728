"""What every reader of a flagship artifact pays before its first weight byte, against the
targets: a manifest built by convert's own code for a published model at tp8 x pp2.

    python scripts/bench_scale.py [--tp 8 --pp 2] [--dir DIR]
        [--model deepseek-v3|kimi-k2-thinking|kimi-k3-dspark ...] [--json]

Each source is a sparse checkpoint with the published shapes (scripts/bench_plan.py: valid
safetensors headers followed by holes). The artifact beside it is made the same way: the
plan's rank files as headers and holes, and the manifest `convert` writes for them
(`convert.record.manifest_of`, `write_manifest`), with each rank file's sha256 taken of its
header alone (hashing holes measures the disk, not shardprep). Each figure is one fresh
process, its time and the growth of its resident memory (VmRSS after less before, the
imports already done), and its ratio to the target:

- plan: `shardprep plan` (all of it, peak RSS);
- write: the manifest built and written at the end of a conversion;
- worker: one vLLM worker's start-up at the artifact's own topology, the last stage's
  last tp rank (the one that also loads the draft): the manifest read as the loader reads
  it, the model entries found, and each role's rank files checked against it (sizes and
  headers), as `read_rank` does before it reads a byte; the largest of target and draft;
- worker tp4: the same at tp4 x pp2 (the artifact regrouped): the blocks that worker
  reads, planned from the manifest and its regions;
- inspect: `shardprep inspect --json`;
- verify: `shardprep verify` less the hashing of the rank files' bytes (I/O);
- fetch: which files `shardprep fetch REPO --stage 1` downloads, from the manifest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_plan

TARGETS = {  # figure -> (seconds, MB)
    "plan": (10.0, 1024.0),
    "write": (10.0, 1024.0),
    "worker": (1.0, 200.0),
    "worker tp4": (10.0, 1024.0),
    "inspect": (5.0, 1024.0),
    "verify": (5.0, 1024.0),
    "fetch": (5.0, 1024.0),
}
MODELS = {  # model -> (bench_plan's name of the target, its files, a draft)
    "deepseek-v3": ("deepseek-v3", 163, None),
    "kimi-k2-thinking": ("kimi-k2-thinking", 62, None),
    "kimi-k3-dspark": ("kimi-k3-mxfp4", 96, "kimi-k3-dspark"),
}

MEASURE = """
import json, sys, time
from pathlib import Path

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def measure(run):
    before, started = rss(), time.perf_counter()
    result = run()
    print(json.dumps({"seconds": time.perf_counter() - started, "rss": rss() - before,
                      "result": result}))
"""

BUILD = """
import dataclasses, hashlib, os
from shardprep.convert import run as convert_run
from shardprep.convert.record import manifest_of
from shardprep.format import manifest as mf
from shardprep.format.headers import encode_header
source, draft, out, tp, pp = sys.argv[1], sys.argv[2], Path(sys.argv[3]), *map(int, sys.argv[4:6])
options = convert_run.Options(tp=tp, pp=pp, draft=draft or None,
                              draft_method="dspark" if draft else None)
plan, checkpoints = convert_run.load_and_plan(source, options)
done = {}
for file in plan.files:
    header = encode_header([t.spec for t in file.tensors], {"format": "pt"})
    path = out / file.path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(header)
        handle.truncate(len(header) + file.nbytes)
    done[file.path] = hashlib.sha256(header).hexdigest()
sources = {role: str(c.root) for role, c in checkpoints.items()}
request = options.request(plan, draft or None)

def write():
    manifest = manifest_of(plan, checkpoints, sources, done, {}, [])
    manifest = dataclasses.replace(manifest, request=request)
    mf.write_manifest(out, manifest)
    return {"files": len(plan.files)}

measure(write)
"""

WORKER = """
from shardprep.format.manifest import read_manifest
from shardprep.loader.reader import check_rank_files
artifact, pp, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def start():
    checked = {}
    for role in ("target", "draft"):  # the loader reads the manifest for each
        manifest = read_manifest(artifact)
        if manifest.model(role) is not None:
            files = check_rank_files(artifact, manifest, role, pp, tp, verify=False)
            checked[role] = sum(len(f.header.tensors) for f in files)
    return checked

measure(start)
"""

WORKER_TP4 = """
from shardprep.format.manifest import read_manifest, read_regions, rank_key
from shardprep.plan.many import no_cycle_collection
from shardprep.plan.regions import tp_ranks_for
from shardprep.plan.regroup import plan_regroup
from shardprep.plan.topology import ExpertSplit
artifact, pp, tp, tp_size = Path(sys.argv[1]), *map(int, sys.argv[2:5])

def start():
    reads = {}
    for role in ("target", "draft"):
        manifest = read_regions(artifact, read_manifest(artifact))
        entry = manifest.model(role)
        if entry is None:
            continue
        stored = tp_ranks_for(manifest.topology.tp, tp_size, tp)
        wanted = sorted({n for t in stored for n in entry.ranks.get(rank_key(pp, t), {})})
        experts = None
        if entry.experts is not None:
            experts = (ExpertSplit(entry.experts.num_experts, tp_size), tp)
        planned = plan_regroup(artifact, manifest, entry, wanted, tp=tp_size, tp_rank=tp,
                               experts=experts, stages=(pp,))
        reads[role] = sum(len(made.reads) for made in planned)
    return reads

with no_cycle_collection():  # as the loader regroups
    measure(start)
"""

CLI = """
import contextlib, io
from shardprep.cli import main
from shardprep.convert import verify
verify._check_hashes = lambda *args: None  # the rank files' bytes: I/O, not shardprep
args = sys.argv[1:]

def cli():
    with contextlib.redirect_stdout(io.StringIO()):
        return {"code": main(args)}

measure(cli)
"""

FETCH = """
from shardprep.format.manifest import read_manifest
from shardprep.hub.cache_parts import requested_parts, wanted_files
artifact = Path(sys.argv[1])

def plan_fetch():
    manifest = read_manifest(artifact)
    parts = requested_parts(manifest, "org/model", 1, None, False)
    return {"files": sum(len(wanted_files(manifest, part)) for part in parts)}

measure(plan_fetch)
"""


def child(code: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE + code, *args], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"a measured step failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan_figure(source: Path, tp: int, pp: int, extra: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", bench_plan.PLAN_CHILD, str(source), str(tp), str(pp), *extra],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    run = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": run["seconds"], "rss": run["max_rss"], "result": {"code": run["code"]}}


def bench_model(root: Path, model: str, tp: int, pp: int) -> dict:
    name, files, draft_name = MODELS[model]
    source, draft, out = root / f"{model}-source", root / f"{model}-draft", root / f"{model}-out"
    for folder in (source, draft, out):
        shutil.rmtree(folder, ignore_errors=True)
    bench_plan.write_sparse_deepseek_v3(source, files, name)
    extra = []
    if draft_name:
        bench_plan.write_sparse_deepseek_v3(draft, 1, draft_name)
        extra = ["--draft", str(draft), "--draft-method", "dspark"]
    figures = {"plan": plan_figure(source, tp, pp, extra)}
    out.mkdir(parents=True)
    figures["write"] = child(
        BUILD, str(source), str(draft) if draft_name else "", str(out), str(tp), str(pp)
    )
    figures["worker"] = child(WORKER, str(out), str(pp - 1), str(tp - 1))
    if tp % 2 == 0:
        figures["worker tp4"] = child(WORKER_TP4, str(out), str(pp - 1), "0", str(tp // 2))
    figures["inspect"] = child(CLI, "inspect", "--json", str(out))
    figures["verify"] = child(CLI, "verify", "--quiet", str(out))
    figures["fetch"] = child(FETCH, str(out))
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    for folder in (source, draft, out):
        shutil.rmtree(folder, ignore_errors=True)
    return {"model": model, "tp": tp, "pp": pp, "files": sizes, "figures": figures}


def print_table(result: dict) -> None:
    sizes = ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in result["files"].items())
    print(f"{result['model']} at tp{result['tp']} x pp{result['pp']}: {sizes}")
    print(f"  {'figure':<11} {'seconds':>8} {'target':>7} {'ratio':>6} {'MB':>8} {'target':>7} "
          f"{'ratio':>6}")  # fmt: skip
    for figure, run in result["figures"].items():
        seconds, mb = TARGETS[figure]
        used = run["rss"] / 1e6
        print(
            f"  {figure:<11} {run['seconds']:8.2f} {seconds:7.0f} {run['seconds'] / seconds:6.2f}"
            f" {used:8.0f} {mb:7.0f} {used / mb:6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dir", default="bench-scale")
    parser.add_argument("--model", choices=sorted(MODELS), action="append")
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    args = parser.parse_args()
    for model in args.model or list(MODELS):
        result = bench_model(Path(args.dir), model, args.tp, args.pp)
        if args.json:
            print(json.dumps(result))
        else:
            print_table(result)


if __name__ == "__main__":
    main()
