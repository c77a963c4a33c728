"""Rank-local loading, side by side: bytes read and throughput per rank, and vLLM's
time to ready.

    python scripts/bench_load.py --size 3GB [--ranks 0:0,1:7] [--dir DIR] [--json]
    python scripts/bench_load.py --vllm [--dir DIR]     # time to ready, real vLLM, tp2 x pp2

Part one converts a synthetic Llama-shaped bf16 checkpoint at tp8 x pp2 and, for each
chosen rank, from a cold page cache, in a child process that reads its own I/O counters:
(a) shardprep's rank-local reader (sharded-fast), (b) the default way (open the source
files that hold the stage with safetensors and cut the rank's slices), (c) fastsafetensors
over those source files, (d) a raw sequential read of the rank's own files (the limit).
Part two starts a real vLLM (CPU, tp2 x pp2) on a model of about 1 GB with each load
format and prints the time until it is ready, as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import drop_caches, write_checkpoint

from shardprep.cli import parse_size
from shardprep.convert import Options, convert

METHODS = ("sharded-fast", "default", "fastsafetensors", "raw")

CHILD = r"""
import json, os, sys, time
from pathlib import Path
method, source, artifact, pp, tp = sys.argv[1:6]
pp, tp = int(pp), int(tp)
from shardprep.manifest import read_manifest
from shardprep.convert import load_and_plan, Options
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


def vllm_ready(args: argparse.Namespace) -> dict:
    """Seconds until `LLM(...)` returns, tp2 x pp2, each load format (bf16, about 1 GB)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(tests))
    import vllm_env

    from shardprep.tiny import make_tiny_model

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    model = make_tiny_model(
        root / "model", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
        torch_dtype="bfloat16",
    )  # fmt: skip
    artifact = root / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    timings = {}
    for label, folder, fmt in (
        ("default", model, "auto"),
        ("sharded-fast", artifact, "sharded-fast"),
    ):
        drop_caches()
        start = time.perf_counter()
        vllm_env.generate(folder, 2, 2, fmt, dtype="bfloat16", max_tokens=1, prompts=[[1, 2]])
        timings[label] = time.perf_counter() - start
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="3GB")
    parser.add_argument("--ranks", default="0:0,1:7", help="pp:tp pairs")
    parser.add_argument("--dir", default="bench-load")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--vllm", action="store_true", help="time to ready of a real vLLM")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.vllm:
        timings = vllm_ready(args)
        if args.json:
            print(json.dumps(timings, indent=1))
            return
        base = timings["default"]
        for label, seconds in timings.items():
            print(f"{label:<14} {seconds:7.1f} s   {seconds / base:5.2f}x of default")
        return
    rows = reader_table(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_reader_table(rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
