"""Rank-local loading, side by side: bytes read and throughput per rank, and vLLM's
time to ready.

    python scripts/bench_load.py --size 3GB [--ranks 0:0,1:7] [--dir DIR] [--json]
    python scripts/bench_load.py --vllm [--before CHECKOUT]   # real vLLM, tp2 x pp2

Part one converts a synthetic Llama-shaped bf16 checkpoint at tp8 x pp2 and, for each
chosen rank, from a cold page cache, in a child process that reads its own I/O counters:
(a) shardprep's rank-local reader (sharded-fast), (b) the default way (open the source
files that hold the stage with safetensors and cut the rank's slices), (c) fastsafetensors
over those source files, (d) a raw sequential read of the rank's own files (the limit).
Part two starts a real vLLM (CPU, tp2 x pp2) on a bf16 model of about 2 GB with each
load format (the default loader, vLLM's `fastsafetensors`, vLLM's `sharded_state` on the
artifact plus the attention scale buffers it requires, and `sharded-fast`), each from a
cold page cache, and prints the weight-load phase of worker pp0 tp0 ("Loading weights
took", which vLLM's loaders log on that worker only; "shardprep loaded" for sharded-fast,
whose slowest worker is shown too) and the time until it answered, as ratios to the
default loader. It holds the harness lock (one vLLM at a time) for the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import drop_caches, write_checkpoint

from shardprep.cli import parse_size
from shardprep.convert.run import Options, convert

METHODS = ("sharded-fast", "default", "fastsafetensors", "raw")

CHILD = r"""
import json, os, sys, time
from pathlib import Path
method, source, artifact, pp, tp = sys.argv[1:6]
pp, tp = int(pp), int(tp)
from shardprep.format.manifest import read_manifest
from shardprep.convert.run import load_and_plan, Options
manifest = read_manifest(Path(artifact))
files = [Path(artifact) / f.path for f in manifest.rank_files("target", pp, tp)]
topo = manifest.topology
io0 = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
start = time.perf_counter()
consumed = 0
if method == "raw":
    buf = bytearray(64 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                consumed += n
elif method == "sharded-fast":
    from shardprep.loader.reader import read_rank
    for name, t in read_rank(Path(artifact), "target", pp, tp, manifest=manifest):
        consumed += t.nbytes
else:
    plan, cps = load_and_plan(source, Options(tp=topo.tp, pp=topo.pp, stage=pp))
    cp = cps["target"]
    wanted = {}
    for f in plan.files:
        if f.tp == tp:
            for t in f.tensors:
                for b in t.blocks:
                    if b.source:
                        wanted.setdefault(b.source, []).append(b)
    stage_files = sorted({cp.tensors[n].file for n in wanted})
    def cut(name, tensor):
        global consumed
        for b in wanted.get(name, []):
            part = tensor[b.rows[0]:b.rows[1]]
            if b.cols:
                part = part[:, b.cols[0]:b.cols[1]]
            consumed += part.contiguous().nbytes
    if method == "default":
        from safetensors import safe_open
        for file in stage_files:
            with safe_open(str(cp.root / file), framework="pt") as f:
                for name in f.keys():
                    cut(name, f.get_tensor(name))
    else:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        for file in stage_files:
            loader = SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True)
            loader.add_filenames({0: [str(cp.root / file)]})
            buffer = loader.copy_files_to_device()
            for name in buffer.key_to_rank_lidx:
                cut(name, buffer.get_tensor(name))
            buffer.close(); loader.close()
seconds = time.perf_counter() - start
io1 = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
print(json.dumps({"seconds": seconds, "consumed": consumed,
                  "read_bytes": int(io1["read_bytes"]) - int(io0["read_bytes"]),
                  "rank_bytes": sum(p.stat().st_size for p in files)}))
"""


def measure(method: str, source: Path, artifact: Path, pp: int, tp: int) -> dict:
    drop_caches()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, method, str(source), str(artifact), str(pp), str(tp)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def reader_table(args: argparse.Namespace) -> dict:
    root = Path(args.dir)
    source, artifact = root / "source", root / "artifact"
    shutil.rmtree(root, ignore_errors=True)
    write_checkpoint(source, parse_size(args.size))
    convert(str(source), artifact, Options(tp=8, pp=2), progress=False)
    ranks = [tuple(int(x) for x in item.split(":")) for item in args.ranks.split(",")]
    rows: dict[str, dict] = {}
    for _ in range(args.repeat):  # methods take turns; the best of each is kept
        for pp, tp in ranks:
            for method in METHODS:
                run = measure(method, source, artifact, pp, tp)
                key = f"pp{pp}-tp{tp}/{method}"
                if key not in rows or run["seconds"] < rows[key]["seconds"]:
                    rows[key] = run
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def print_reader_table(rows: dict) -> None:
    # read_bytes comes from /proc/self/io; pages that safetensors maps (default) are
    # under-counted there, so the default's amplification is a lower bound.
    print(f"{'rank':<10} {'method':<16} {'read/rank':>10} {'GB/s':>7} {'vs raw':>7}")
    for key, row in rows.items():
        rank, method = key.split("/")
        raw = rows[f"{rank}/raw"]
        speed = row["rank_bytes"] / row["seconds"] / 1e9
        raw_speed = raw["rank_bytes"] / raw["seconds"] / 1e9
        print(f"{rank:<10} {method:<16} {row['read_bytes'] / row['rank_bytes']:>9.2f}x "
              f"{speed:>7.2f} {speed / raw_speed:>6.2f}x")  # fmt: skip


# The weight-load phase as each loader logs it. vLLM's loaders log it with `info_once`,
# whose default scope is the first local rank: worker pp0 tp0 only. sharded-fast logs it
# on every worker, naming the rank; like is compared with like on pp0 tp0.
LOAD_PHASE = (
    re.compile(r"Loading weights took ([\d.]+) seconds"),  # vLLM's default/sharded_state
    re.compile(r"shardprep loaded \d+ tensors of .* in ([\d.]+) s"),  # sharded-fast
)
ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
ROOT_CAUSE = re.compile(r"\b(?!EngineCore)\w*(Error|Exception): (?!Engine core initialization).*")


def vllm_model(root: Path, layers: int) -> Path:
    """A bf16 Llama of about 0.26 + 0.09 x `layers` GB (20 layers: 2.06 GB)."""
    from shardprep.demo.tiny import make_tiny_model

    return make_tiny_model(
        root / "model", hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
        torch_dtype="bfloat16",
    )  # fmt: skip


def with_attention_scales(artifact: Path, out: Path) -> Path:
    """vLLM's own `sharded_state` format from an artifact: the same rank files plus the
    attention scale buffers `sharded_state` requires (see the README)."""
    import torch
    from safetensors.torch import load_file, save_file

    from shardprep.format.manifest import read_manifest

    shutil.copytree(artifact, out)
    for entry in read_manifest(out).files:
        tensors = load_file(out / entry.path)
        layers = {n.split(".")[2] for n in tensors if n.startswith("model.layers.")}
        for layer in sorted(layers, key=int):
            for scale in ATTENTION_SCALES:
                tensors[f"model.layers.{layer}.self_attn.attn.{scale}"] = torch.tensor(1.0)
        save_file(tensors, out / entry.path)
    return out


def vllm_contenders(args: argparse.Namespace, model: Path, root: Path) -> list[tuple]:
    """(label, model folder, load format, extra config, PYTHONPATH or None) to start."""
    from shardprep.constants import VLLM_SHARDED_STATE_PATTERN

    artifact = root / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    sharded_state = with_attention_scales(artifact, root / "sharded-state")
    pattern = {"pattern": VLLM_SHARDED_STATE_PATTERN}
    chosen = [
        ("default", model, "auto", None, None),
        ("fastsafetensors", model, "fastsafetensors", None, None),
        ("sharded_state", sharded_state, "sharded_state", pattern, None),
        ("sharded-fast", artifact, "sharded-fast", None, None),
    ]
    if args.before:
        chosen.append(("sharded-fast (before)", artifact, "sharded-fast", None, args.before))
    return chosen


def start_vllm(
    folder: Path, fmt: str, extra: dict | None, pythonpath: str | None, cache: str
) -> dict:
    """Start a real vLLM (tp2 x pp2, one token), from a cold page cache (or with the
    model's files read once just before, `warm`); the time until it answered, and the
    load phase each worker logged."""
    import vllm_env

    tmpdir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    runner = vllm_env.runner_args(
        folder, 2, 2, fmt, dtype="bfloat16", max_tokens=1, prompts=[[1, 2]],
        model_loader_extra_config=extra,
    )  # fmt: skip
    env = vllm_env.vllm_environ(4, tmpdir, {"PYTHONPATH": pythonpath} if pythonpath else None)
    if cache == "cold":
        drop_caches()
    else:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                path.read_bytes()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [vllm_env.require_python(), *runner], cwd=vllm_env.REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=vllm_env.DEFAULT_TIMEOUT)
    finally:
        vllm_env.kill_group(proc)
    seconds = time.perf_counter() - start
    vllm_env.remove_dist_files(tmpdir, output)
    phases = load_phases(output)
    if proc.returncode != 0:
        # The root cause: the first exception a worker raised, not the engine's summary.
        causes = [m[0] for line in output.splitlines() if (m := ROOT_CAUSE.search(line))]
        lines = causes or output.splitlines() or ["no output"]
        return {"error": lines[0].strip()[:300]}
    return {
        "ready_seconds": seconds,
        "load_seconds": phases.get(FIRST_RANK),
        "slowest_seconds": max(phases.values(), default=None),
        "ranks": phases,
    }


FIRST_RANK = "pp0-tp0"
RANK = re.compile(r"rank pp(\d+) tp(\d+)\)")


def load_phases(output: str) -> dict[str, float]:
    """The load phase each worker logged, by rank ("pp0-tp0"); a line that names no rank
    (vLLM's own loaders) is the first local rank's."""
    phases: dict[str, float] = {}
    for line in output.splitlines():
        for pattern in LOAD_PHASE:
            if match := pattern.search(line):
                rank = RANK.search(line)
                phases[f"pp{rank[1]}-tp{rank[2]}" if rank else FIRST_RANK] = float(match[1])
    return phases


def vllm_ready(args: argparse.Namespace) -> dict:
    """Time to ready and weight-load phase of each load format, tp2 x pp2, bf16."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import vllm_env

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    results: dict[str, dict] = {}
    # One vLLM (and one long benchmark) at a time on this machine: building the model
    # also runs under the lock, so as not to disturb another benchmark.
    with vllm_env.one_vllm_at_a_time():
        try:
            model = vllm_model(root, args.layers)
            chosen = vllm_contenders(args, model, root)
            for _ in range(args.repeat):  # take turns; keep the best of each
                for label, folder, fmt, extra, pythonpath in chosen:
                    if args.formats and label.split(" ")[0] not in args.formats.split(","):
                        continue
                    run = start_vllm(folder, fmt, extra, pythonpath, args.cache)
                    best = results.get(label)
                    if (
                        best is None
                        or "error" in best
                        or ("error" not in run and run["load_seconds"] < best["load_seconds"])
                    ):
                        results[label] = run
            results["_source_bytes"] = {
                "bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))
            }
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    return results


def print_vllm(results: dict, cache: str) -> None:
    size = results.pop("_source_bytes")["bytes"]
    print(f"vLLM (CPU) tp2 x pp2, bf16 Llama of {size / 1e9:.2f} GB, {cache} page cache")
    print(f"{'load format':<22} {'load phase':>10} {'vs default':>10} {'slowest':>8} "
          f"{'ready':>8} {'vs default':>10}")  # fmt: skip
    base = results["default"]
    for label, run in results.items():
        if "error" in run:
            print(f"{label:<22} cannot run here: {run['error']}")
            continue
        load, ready = run["load_seconds"], run["ready_seconds"]
        print(f"{label:<22} {load:>9.2f}s {load / base['load_seconds']:>9.2f}x "
              f"{run['slowest_seconds']:>7.2f}s "
              f"{ready:>7.1f}s {ready / base['ready_seconds']:>9.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="3GB")
    parser.add_argument("--ranks", default="0:0,1:7", help="pp:tp pairs")
    parser.add_argument("--dir", default="bench-load")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--vllm", action="store_true", help="load phase of a real vLLM")
    parser.add_argument("--layers", type=int, default=20, help="--vllm: model layers")
    parser.add_argument("--before", help="--vllm: also sharded-fast from this checkout")
    parser.add_argument("--cache", default="cold", help="--vllm: cold or warm page cache")
    parser.add_argument("--formats", help="--vllm: only these, e.g. default,sharded-fast")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.vllm:
        results = vllm_ready(args)
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            print_vllm(results, args.cache)
        return
    rows = reader_table(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_reader_table(rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
