"""Rank-local loading, side by side: bytes read and throughput per rank, and every
rank's weight-load phase in a real vLLM.

    python scripts/bench_load.py --size 3GB [--ranks 0:0,1:7] [--dir DIR] [--json]
    python scripts/bench_load.py --vllm [--repeat 3] [--cache cold,warm] \
        [--topologies tp2,tp2xpp2] [--formats default,sharded-fast] [--before CHECKOUT]
    python scripts/bench_load.py --vllm --table RESULTS  # the table of a --json output

Part one converts a synthetic Llama-shaped bf16 checkpoint at tp8 x pp2 and, for each
chosen rank, from a cold page cache, in a child process that reads its own I/O counters:
(a) shardprep's rank-local reader (sharded-fast), (b) the default way (open the source
files that hold the stage with safetensors and cut the rank's slices), (c) fastsafetensors
over those source files, (d) a raw sequential read of the rank's own files (the limit).

Part two (`--vllm`, as root: it drops the page cache) starts a real vLLM (CPU, bf16
Llama of about 1 GB with the default 8 layers) once per loader, topology and page-cache
state, in alternating rounds. Every rank's `load_weights` is timed by one wrapper, the
same for every loader: the timing plugin of tests/vllm_dump_plugin
(`$SHARDPREP_LOAD_TIMES`), put first on the workers' PYTHONPATH. `cold`: the page cache
dropped just before the engine starts; `warm`: dropped, then the contender's weight
files read once and held in the page cache (locked by a helper process) until the
engine stops. The engine is stopped once every rank has reported (`--ready`: run to
the first token and report the time to ready too). The measured checkouts' bytecode is
written first, as installing shardprep does. Printed: each run's ranks, then per
cell the best round's ranks and its slowest rank against the default loader's slowest,
each round's slowest rank against the default loader's of the same round (the spread),
and the git revision of the code measured. It holds the harness lock (one vLLM at a
time) for the whole run.
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
from dataclasses import dataclass
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import drop_caches, write_checkpoint

from shardprep.cli.sizes import parse_size
from shardprep.convert.run import Options, convert

METHODS = ("sharded-fast", "default", "fastsafetensors", "raw")
TIMES_ENV = "SHARDPREP_LOAD_TIMES"  # the timing plugin's (tests/vllm_dump_plugin)

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


ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
ROOT_CAUSE = re.compile(r"\b(?!EngineCore)\w*(Error|Exception): (?!Engine core initialization).*")
TOPOLOGIES = {"tp2": (2, 1), "tp2xpp2": (2, 2)}
FORMATS = ("default", "sharded-fast", "sharded_state")
THIS_CHECKOUT = Path(__file__).resolve().parents[1]
TESTS = THIS_CHECKOUT / "tests"
TIMING_PLUGIN = TESTS / "vllm_dump_plugin"


def vllm_model(root: Path, layers: int) -> Path:
    """A bf16 Llama of about 0.26 + 0.09 x `layers` GB (8 layers: 0.98 GB)."""
    from shardprep.demo.tiny import make_tiny_model

    if (root / "model" / "config.json").is_file():  # kept (--keep) from an earlier run
        return root / "model"
    return make_tiny_model(
        root / "model", hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
        torch_dtype="bfloat16",
    )  # fmt: skip


def with_attention_scales(artifact: Path, out: Path) -> Path:
    """vLLM's own `sharded_state` format from an artifact: the same rank files plus the
    attention scale buffers `sharded_state` requires (see docs/serving.md)."""
    import torch
    from safetensors.torch import load_file, save_file

    from shardprep.format.manifest import read_manifest

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(artifact, out)
    for entry in read_manifest(out).files:
        tensors = load_file(out / entry.path)
        layers = {n.split(".")[2] for n in tensors if n.startswith("model.layers.")}
        for layer in sorted(layers, key=int):
            for scale in ATTENTION_SCALES:
                tensors[f"model.layers.{layer}.self_attn.attn.{scale}"] = torch.tensor(1.0)
        save_file(tensors, out / entry.path)
    return out


@dataclass(frozen=True)
class Contender:
    label: str  # "default", "sharded-fast", "sharded_state", "sharded-fast (before)"
    loader: str  # the loader the timing plugin names
    folder: Path
    load_format: str
    extra: dict | None = None
    pythonpath: str | None = None  # a checkout to import shardprep from


def vllm_contenders(args: argparse.Namespace, model: Path, root: Path, tp: int, pp: int):
    """The engines to start for one topology, converting its artifact once."""
    from shardprep.constants import VLLM_SHARDED_STATE_PATTERN

    artifact = root / f"artifact-tp{tp}-pp{pp}"
    if not (artifact / "shardprep.json").is_file():
        convert(str(model), artifact, Options(tp=tp, pp=pp), progress=False)
    wanted = args.formats.split(",")
    chosen = []
    if "default" in wanted:
        chosen.append(Contender("default", "default", model, "auto"))
    if "sharded-fast" in wanted:
        chosen.append(Contender("sharded-fast", "sharded-fast", artifact, "sharded-fast"))
    if "sharded_state" in wanted:
        state = with_attention_scales(artifact, root / f"sharded-state-tp{tp}-pp{pp}")
        extra = {"pattern": VLLM_SHARDED_STATE_PATTERN}
        chosen.append(Contender("sharded_state", "sharded_state", state, "sharded_state", extra))
    if args.before:
        label = "sharded-fast (before)"
        chosen.append(Contender(label, "sharded-fast", artifact, "sharded-fast", None, args.before))
    return chosen


# Keeps files in the page cache: maps each one shared and read-only and locks it
# (mlock), until killed. On this machine the kernel's proactive reclaim (DAMON
# `pageout`, kdamond) evicted rank files read once within 5 s, long before vLLM loads.
PIN_FILES = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value) or libc.mlock(addr, size) != 0:
        sys.exit(f"cannot pin {path}: errno {ctypes.get_errno()}")
print("pinned", flush=True)
signal.pause()
"""


def page_cache(folder: Path, cache: str) -> subprocess.Popen[str] | None:
    """Drop the page cache; for `warm`, then read the contender's weight files once and
    keep them there (a process that holds them locked, to be killed after the run)."""
    if not drop_caches():
        sys.exit("bench_load: cannot write /proc/sys/vm/drop_caches (root needed for --vllm)")
    if cache != "warm":
        return None
    files = [str(p) for p in sorted(folder.rglob("*.safetensors"))]
    pin = subprocess.Popen(
        [sys.executable, "-c", PIN_FILES, *files], stdout=subprocess.PIPE, text=True
    )
    if pin.stdout is None or pin.stdout.readline().strip() != "pinned":
        pin.kill()
        sys.exit("bench_load: could not keep the weight files in the page cache (mlock)")
    return pin


def start_vllm(contender: Contender, tp: int, pp: int, cache: str, ready: bool) -> dict:
    """Start a real vLLM with one loader and time every rank's `load_weights` with the
    timing plugin (tests/vllm_dump_plugin, `$SHARDPREP_LOAD_TIMES`). The engine is
    stopped as soon as every rank has reported, unless `ready` (then it answers one
    token and the time until then is reported too)."""
    import vllm_env

    tmpdir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    times = tmpdir / "load-times.jsonl"
    log = tmpdir / "vllm.log"
    runner = vllm_env.runner_args(
        contender.folder, tp, pp, contender.load_format, dtype="bfloat16", max_tokens=1,
        prompts=[[1, 2]], model_loader_extra_config=contender.extra,
    )  # fmt: skip
    paths = [contender.pythonpath] if contender.pythonpath else []
    paths += [str(TIMING_PLUGIN), os.environ.get("PYTHONPATH", "")]
    extra_env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p), TIMES_ENV: str(times)}
    env = vllm_env.vllm_environ(tp * pp, tmpdir, extra_env)
    pin = page_cache(contender.folder, cache)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [vllm_env.require_python(), *runner], cwd=vllm_env.REPO, env=env, text=True,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    ranks: list[dict] = []
    try:
        deadline = time.monotonic() + vllm_env.DEFAULT_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            ranks = read_times(times)
            if not ready and len(ranks) >= tp * pp:
                break
    finally:
        vllm_env.kill_group(proc)
        proc.wait()
        if pin is not None:
            pin.kill()
            pin.wait()
    seconds = time.perf_counter() - start
    ranks = read_times(times)
    output = log.read_text(errors="replace")
    vllm_env.remove_dist_files(tmpdir, output)
    ranks = [r for r in ranks if r["role"] == "target" and r["loader"] == contender.loader]
    if len(ranks) < tp * pp or (ready and proc.returncode != 0):
        # The root cause: the first exception a worker raised, not the engine's summary.
        causes = [m[0] for line in output.splitlines() if (m := ROOT_CAUSE.search(line))]
        lines = causes or [f"{len(ranks)} of {tp * pp} ranks reported a load time"]
        return {"error": lines[0].strip()[:300]}
    return {
        "ranks": {f"pp{r['pp_rank']}-tp{r['tp_rank']}": r["seconds"] for r in ranks},
        "slowest": max(r["seconds"] for r in ranks),
        "cpu": {  # CPU seconds of each worker process meanwhile (older plugins: absent)
            f"pp{r['pp_rank']}-tp{r['tp_rank']}": r["cpu_seconds"]
            for r in ranks
            if "cpu_seconds" in r
        },
        "rss_gb": {
            f"pp{r['pp_rank']}-tp{r['tp_rank']}": (r["rss_after"] - r["rss_before"]) / 1e9
            for r in ranks
        },
        "ready_seconds": seconds if ready else None,
    }


def read_times(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def compile_bytecode(python: str, checkout: Path) -> None:
    """Write the bytecode of `checkout`'s package with the workers' Python, as installing
    it does. Without it (a checkout under PYTHONDONTWRITEBYTECODE) every worker compiles
    the modules sharded-fast imports during `load_weights` from source again, at each start:
    10 ms or more of its load phase that no installed shardprep spends."""
    subprocess.run(
        [python, "-m", "compileall", "-q", str(checkout / "shardprep")], check=True,
        stdout=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
    )  # fmt: skip


def revision(checkout: Path) -> str:
    """The commit of a checkout, marked `+dirty` when it has changes not committed."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return f"{checkout} (not a git checkout)"
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def vllm_load_times(args: argparse.Namespace) -> dict:
    """Every rank's load_weights seconds, each loader, topology and page-cache state, in
    alternating rounds."""
    sys.path.insert(0, str(TESTS / "support"))
    import vllm_env

    root = Path(args.dir)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    topologies = [TOPOLOGIES[name] for name in args.topologies.split(",")]
    caches = args.cache.split(",")
    runs: list[dict] = []
    # One vLLM (and one long benchmark) at a time on this machine: building the model
    # also runs under the lock, so as not to disturb another benchmark.
    with vllm_env.one_vllm_at_a_time():
        for checkout in [THIS_CHECKOUT] + ([Path(args.before)] if args.before else []):
            compile_bytecode(vllm_env.require_python(), checkout)
        try:
            model = vllm_model(root, args.layers)
            chosen = {(tp, pp): vllm_contenders(args, model, root, tp, pp) for tp, pp in topologies}
            for round_ in range(1, args.repeat + 1):  # take turns
                for (tp, pp), contenders in chosen.items():
                    for cache in caches:
                        for contender in contenders:
                            run = start_vllm(contender, tp, pp, cache, args.ready)
                            run |= {"round": round_, "tp": tp, "pp": pp, "cache": cache,
                                    "label": contender.label}  # fmt: skip
                            print_run(run)
                            runs.append(run)
            size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    revisions = {"this": revision(THIS_CHECKOUT)}
    if args.before:
        revisions["before"] = revision(Path(args.before))
    return {"source_bytes": size, "revisions": revisions, "runs": runs}


def print_run(run: dict) -> None:
    where = f"round {run['round']} {run['cache']} tp{run['tp']} x pp{run['pp']} {run['label']}"
    if "error" in run:
        print(f"{where}: cannot run here: {run['error']}", flush=True)
        return
    ranks = " ".join(f"{k} {v:.2f}" for k, v in sorted(run["ranks"].items()))
    print(f"{where}: {ranks} s", flush=True)


def print_vllm(results: dict) -> None:
    """The best round of each cell (least slowest rank), every rank of it, and the ratio
    of the slowest ranks against the default loader's; then each round's slowest rank,
    and its ratio to the default loader's slowest rank of the same round (the engines of
    one round ran one after the other, so the load of a shared machine weighs on both)."""
    revisions = ", ".join(f"{k} {v}" for k, v in results["revisions"].items())
    print(f"\nvLLM (CPU), bf16 Llama of {results['source_bytes'] / 1e9:.2f} GB; {revisions}")
    print("load_weights of every rank, one wrapper for every loader; best of the rounds")
    print(f"{'cache':<6} {'layout':<9} {'loader':<22} {'per rank (s)':<44} "
          f"{'slowest':>7} {'vs default':>10}  slowest, each round (vs default)")  # fmt: skip
    cells: dict[tuple, list[dict]] = {}
    for run in results["runs"]:
        cells.setdefault((run["cache"], run["tp"], run["pp"], run["label"]), []).append(run)
    for (cache, tp, pp, label), runs in cells.items():
        layout = f"tp{tp}" if pp == 1 else f"tp{tp}xpp{pp}"
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"{cache:<6} {layout:<9} {label:<22} cannot run here: {runs[0]['error']}")
            continue
        best = min(good, key=lambda r: r["slowest"])
        base = [r for r in cells.get((cache, tp, pp, "default"), []) if "error" not in r]
        ratio = f"{best['slowest'] / min(r['slowest'] for r in base):.2f}x" if base else "-"
        ranks = " ".join(f"{k} {v:.2f}" for k, v in sorted(best["ranks"].items()))
        print(f"{cache:<6} {layout:<9} {label:<22} {ranks:<44} {best['slowest']:>7.2f} "
              f"{ratio:>10}  {each_round(good, base)}")  # fmt: skip


def print_cpu(results: dict) -> None:
    """Per cell, the CPU seconds of every rank's `load_weights`, over all rounds (least and
    median, and the median against the default loader's); then each round's busiest rank
    and its ratio to the default loader's of the same round. The work each loader does,
    which other jobs on a shared machine disturb less than they disturb wall time; but the
    figure counts every thread of the worker, and on a loaded machine a last-stage rank's
    grows with its wall time whatever the loader, so the median is the steadier one."""
    cells: dict[tuple, list[dict]] = {}
    for run in results["runs"]:
        if "error" not in run and run.get("cpu"):
            key = (run["cache"], run["tp"], run["pp"], run["label"])
            cells.setdefault(key, []).append(run | {"slowest": max(run["cpu"].values())})
    if not cells:
        return
    print("\nCPU seconds in load_weights (all threads of a rank's process): every rank of")
    print("every round (least, median, median vs default), and the busiest rank of each round")
    print(f"{'cache':<6} {'layout':<9} {'loader':<22} {'least':>6} {'median':>6} "
          f"{'vs default':>10}  busiest, each round (vs default)")  # fmt: skip
    for (cache, tp, pp, label), runs in cells.items():
        layout = f"tp{tp}" if pp == 1 else f"tp{tp}xpp{pp}"
        base = cells.get((cache, tp, pp, "default"), [])
        every = [seconds for r in runs for seconds in r["cpu"].values()]
        ratio = f"{median(every) / median(s for r in base for s in r['cpu'].values()):.2f}x"
        print(f"{cache:<6} {layout:<9} {label:<22} {min(every):>6.3f} {median(every):>6.3f} "
              f"{ratio if base else '-':>10}  {each_round(runs, base)}")  # fmt: skip


def each_round(runs: list[dict], base: list[dict]) -> str:
    """Each round's slowest rank, with its ratio to the default loader's of that round."""
    default = {r["round"]: r["slowest"] for r in base}
    return " ".join(
        f"{r['slowest']:.2f}"
        + (f" ({r['slowest'] / default[r['round']]:.2f}x)" if r["round"] in default else "")
        for r in runs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="3GB")
    parser.add_argument("--ranks", default="0:0,1:7", help="pp:tp pairs")
    parser.add_argument("--dir", default="bench-load")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--vllm", action="store_true", help="load phase of a real vLLM")
    parser.add_argument("--layers", type=int, default=8, help="--vllm: model layers")
    parser.add_argument("--before", help="--vllm: also sharded-fast from this checkout")
    parser.add_argument("--cache", default="cold,warm", help="--vllm: cold, warm or both")
    parser.add_argument(
        "--topologies", default="tp2,tp2xpp2", help="--vllm: " + ", ".join(TOPOLOGIES)
    )
    parser.add_argument(
        "--formats", default="default,sharded-fast", help="--vllm: of " + ", ".join(FORMATS)
    )
    parser.add_argument("--ready", action="store_true", help="--vllm: run to the first token")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--table", help="--vllm: print the table of an earlier --json output")
    args = parser.parse_args()
    if args.table:
        text = Path(args.table).read_text()
        results = json.loads(text[text.index("\n{") :])  # after the runs' progress lines
        print_vllm(results)
        print_cpu(results)
        return
    if args.vllm:
        results = vllm_load_times(args)
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            print_vllm(results)
            print_cpu(results)
        return
    rows = reader_table(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_reader_table(rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
