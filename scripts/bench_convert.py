"""Convert throughput, read amplification and peak memory, side by side with `cp` + `sync`.

    python scripts/bench_convert.py --size 4GB [--cache cold,warm] [--layout folder,local,hub]
                                    [--tp 8 --pp 2] [--repeat 3] [--before CHECKOUT]
                                    [--least-work] [--dir DIR] [--json]
    python scripts/bench_convert.py --plan-deepseek [--tp 8 --pp 2] [--dir DIR]

Builds a synthetic Llama-shaped bf16 checkpoint of about SIZE (random weights), then, for
each page-cache state and source layout, takes turns round after round (best of
`--repeat` kept for each contender):

- `cp` of the source files into a fresh folder, then `sync`;
- `shardprep convert` of the same files, run as the command line in a child process
  (interpreter start and imports included, with every module's bytecode compiled first,
  as `pip install` leaves it), then `sync`; the child reports its own I/O counters and
  peak RSS;
- with `--before CHECKOUT`, the same command from another checkout of shardprep (for
  before/after tables measured in one run);
- with `--least-work`, the least work of the kind any conversion must do, with nothing
  else, then `sync`: each file copied inside the kernel (`copy_file_range`) 64 MiB at a
  time, each step of the copy hashed and handed to the disk as convert does, and
  (`folder` only, where the manifest needs it) the file itself hashed, as tasks on one
  thread per core, each hash through `shardprep.hashing`: no plan, no cut, no header.

Besides wall time (best of the rounds, each contender's own best), it prints the CPU
seconds the contender's processes used (user + system, same round), which a machine
shared with other jobs disturbs much less than wall time.

`cold` drops the page cache before each contender (needs root; otherwise says so);
`warm` reads the source files once before each. Then, before each, up to 1.25x the
source's size of free memory is touched and freed (`fault_in`): on a virtual machine that
hands free memory back to its host, the first touch of such memory costs far more, and
without this `cp`, which fills fresh page cache for every byte, paid it or not by chance.
`folder` converts a plain model folder (every source byte is hashed for the manifest);
`local` the same folder as `hf download --local-dir` leaves it (each file's sha256
recorded in `.cache/huggingface/download/`, which the manifest records as it is); `hub`
the same files laid out as a Hugging Face cache snapshot (symlinks to blobs named by their
sha256, recorded as they are). Sha256 of every rank file is included in every case.

`--plan-deepseek` measures `shardprep plan` instead, on a DeepSeek-V3-shaped checkpoint
made of sparse files (time and peak memory; scripts/bench_plan.py does the work).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardprep.cli.sizes import parse_size
from shardprep.demo.tiny import tiny_config
from shardprep.format.headers import TensorSpec, encode_header

THIS_CHECKOUT = Path(__file__).resolve().parents[1]

# Runs `shardprep convert ARGS...` in this process, then reports its own counters.
CHILD = """
import json, resource, sys
import shardprep
from shardprep.cli import main
status = main(["convert", "--quiet", *sys.argv[1:]])
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(json.dumps({"status": status, "read_bytes": int(io["read_bytes"]),
                  "shardprep": shardprep.__file__,
                  "rchar": int(io["rchar"]),
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

# The least work of a conversion: every file copied in the kernel 64 MiB at a time, each
# step of the copy hashed and handed to the disk (as convert does), and, with a last
# argument "hash-source", the file hashed too; one thread per core.
LEAST_WORK = """
import hashlib, os, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from shardprep.hashing import sha256_file, update_from_file
source, dest, hash_source = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "hash-source"
STEP = 64 * 1024**2
def copy_and_hash(path):
    src = os.open(path, os.O_RDONLY)
    dst = os.open(dest / path.name, os.O_RDWR | os.O_CREAT, 0o644)
    size, done, digest = os.fstat(src).st_size, 0, hashlib.sha256()
    while done < size:
        n = os.copy_file_range(src, dst, min(STEP, size - done), done, done)
        update_from_file(digest, dst, done, done + n)
        os.posix_fadvise(dst, done, n, os.POSIX_FADV_DONTNEED)
        done += n
    os.close(src)
    os.close(dst)
    return digest.hexdigest()
with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
    tasks = []
    for path in sorted(source.glob("*.safetensors")):
        tasks.append(pool.submit(copy_and_hash, path))
        if hash_source:
            tasks.append(pool.submit(sha256_file, path))
    [task.result() for task in tasks]
"""


@dataclass(frozen=True)
class Source:
    """A synthetic checkpoint: one set of files, seen as a plain folder, as a folder
    fetched by `hf download --local-dir` and as a Hub snapshot."""

    folder: Path  # plain model folder (hard links to the blobs)
    local: Path  # the same with huggingface_hub's local-dir download metadata
    snapshot: Path  # Hugging Face cache layout: symlinks to blobs named by sha256
    total: int
    largest: int

    def path(self, layout: str) -> Path:
        return {"folder": self.folder, "local": self.local, "hub": self.snapshot}[layout]


def llama_config(size: int) -> dict:
    """Llama-3-8B widths, with as many layers as make about `size` bytes in bf16 (and
    Llama-2's vocabulary below 4 GB, where Llama-3's embeddings alone would be 2 GB)."""
    hidden, inter, heads, kv = 4096, 14336, 32, 8
    vocab = 128256 if size >= 4 * 10**9 else 32000
    per_layer = 2 * (hidden * hidden * 2 + 2 * hidden * (hidden // heads * kv) + 3 * hidden * inter)
    fixed = 2 * 2 * vocab * hidden
    layers = max(2, math.ceil((size - fixed) / per_layer))
    return tiny_config(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
        vocab_size=vocab, torch_dtype="bfloat16",
    )  # fmt: skip


def write_checkpoint(folder: Path, size: int, files: int = 4) -> tuple[int, int]:
    """Random bf16 weights in `files` safetensors files, written chunk by chunk."""
    total, largest, _ = write_checkpoint_files(folder, llama_config(size), files)
    return total, largest


def write_checkpoint_files(
    folder: Path, config: dict, files: int = 4
) -> tuple[int, int, dict[str, str]]:
    """Random bf16 weights for `config` in `files` layer-contiguous safetensors files;
    returns (bytes, largest tensor, sha256 of each file)."""
    from shardprep.plan import archs

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    # Layer by layer, in contiguous files, as Hugging Face checkpoints are laid out.
    shapes = sorted(archs.target_family(config)[1].expected_shapes(config).items(), key=_natural)
    per_file = math.ceil(len(shapes) / files)
    block = torch.randn(32 * 1024**2, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
    block_bytes = block.view(torch.uint8).numpy().tobytes()
    weight_map, total, largest, hashes = {}, 0, 0, {}
    for index in range(files):
        name = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        chunk = shapes[index * per_file : (index + 1) * per_file]
        specs = [TensorSpec(n, "BF16", s) for n, s in chunk]
        digest = hashlib.sha256()
        with open(folder / name, "wb") as file:
            header = encode_header(specs, {"format": "pt"})
            file.write(header)
            digest.update(header)
            for spec in specs:
                left = spec.nbytes
                while left:
                    step = min(left, len(block_bytes))
                    file.write(memoryview(block_bytes)[:step])
                    digest.update(memoryview(block_bytes)[:step])
                    left -= step
                weight_map[spec.name] = name
                largest = max(largest, spec.nbytes)
        hashes[name] = digest.hexdigest()
        total += (folder / name).stat().st_size
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    return total, largest, hashes


def build_source(root: Path, config: dict) -> Source:
    """Write the checkpoint once into Hub-cache blobs; expose it as a plain folder (hard
    links), as a local-dir download (hard links and the metadata file huggingface_hub
    writes beside each, in its format: commit, etag = sha256, time) and as a snapshot
    (symlinks), so that every layout reads the very same bytes."""
    folder = root / "folder"
    total, largest, hashes = write_checkpoint_files(folder, config)
    local = root / "local"
    metadata = local / ".cache" / "huggingface" / "download"
    metadata.mkdir(parents=True)
    for item in sorted(folder.iterdir()):
        os.link(item, local / item.name)
        sha256 = hashes.get(item.name) or hashlib.sha256(item.read_bytes()).hexdigest()
        (metadata / f"{item.name}.metadata").write_text(f"{'0' * 40}\n{sha256}\n{time.time()}\n")
    repo = root / "hub" / "models--bench--synthetic"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / ("0" * 40)
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for item in sorted(folder.iterdir()):
        if item.name in hashes:
            blob = blobs / hashes[item.name]
            os.link(item, blob)
            (snapshot / item.name).symlink_to(os.path.relpath(blob, snapshot))
        else:
            shutil.copyfile(item, snapshot / item.name)
    return Source(folder, local, snapshot, total, largest)


def _natural(item: tuple[str, tuple[int, ...]]) -> list:
    return [int(part) if part.isdigit() else part for part in item[0].split(".")]


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def warm_up(folder: Path) -> None:
    """Read every file of `folder` once, so that it sits in the page cache."""
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while f.read(64 * 1024**2):
                pass


def prepare(cache: str, source: Path) -> bool:
    """Put the page cache in the requested state; False if it could not be dropped."""
    os.sync()
    if cache == "cold":
        return drop_caches()
    warm_up(source)
    return True


def free_memory() -> int | None:
    """MemFree of /proc/meminfo in bytes (None where there is none)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in lines)
    return int(fields["MemFree"].split()[0]) * 1024


def fault_in(nbytes: int) -> None:
    """Touch and free up to `nbytes` of memory (never the page cache the run needs).

    A virtual machine with free page reporting (virtio-balloon) hands memory that stays
    free for a few seconds back to its host, and the next first touch of each such page
    costs a fault in the host: here 0.6-1.7 s per GB, paid by whichever contender fills
    fresh pages. `cp` fills a page-cache page for every byte it copies and so paid it in
    full, by chance of the timing; convert hands its pages back as it goes. Touched here
    first, the pages are back on the free lists, not yet reported, when the contender
    starts: each starts as it would on a machine without reporting."""
    free = free_memory()
    if free is None:
        return
    size = min(nbytes, free - 1024**3)
    if size > 0:  # in a child: a child's peak RSS starts from its parent's at fork
        touch = f"import numpy; numpy.ones({size}, numpy.uint8)"
        subprocess.run([sys.executable, "-c", touch], check=True)


def run_cp(source: Path, dest: Path) -> dict:
    files = [str(p) for p in sorted(source.glob("*.safetensors"))]
    dest.mkdir(parents=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-L", *files, str(dest)], check=True)
    os.sync()
    return {"seconds": time.perf_counter() - start}


def compile_bytecode(checkout: Path) -> None:
    """Write the bytecode of `checkout`'s package, as an install does: without it (say,
    under PYTHONDONTWRITEBYTECODE) each run compiles some modules again."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(checkout / "shardprep")],
        check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
    )  # fmt: skip


def run_convert(
    checkout: Path | None, source: Path, dest: Path, tp: int, pp: int, extra: list[str]
) -> dict:
    """`shardprep convert` from `checkout` (None: the one holding this script), + sync."""
    env = dict(os.environ, PYTHONPATH=str(checkout or THIS_CHECKOUT))
    # -P: without it, `-c` puts the working directory first on sys.path, and a checkout
    # there would be imported whatever PYTHONPATH says.
    cmd = [sys.executable, "-P", "-c", CHILD, str(source), "-o", str(dest)]
    cmd += ["--tp", str(tp), "--pp", str(pp), *extra]
    start = time.perf_counter()
    result = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    os.sync()
    seconds = time.perf_counter() - start
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if report["status"] != 0:
        raise SystemExit(f"convert failed: {result.stderr.strip()}")
    expected = Path(env["PYTHONPATH"]).resolve()
    if not Path(report["shardprep"]).resolve().is_relative_to(expected):
        raise SystemExit(f"convert ran shardprep from {report['shardprep']}, not {expected}")
    return {"seconds": seconds, **report}


def run_least_work(source: Path, dest: Path, hash_source: bool) -> dict:
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-P", "-c", LEAST_WORK, str(source), str(dest)]
    cmd.append("hash-source" if hash_source else "copies-only")
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(THIS_CHECKOUT)))
    os.sync()
    return {"seconds": time.perf_counter() - start}


Contender = Callable[[Path, Path], dict]  # (source folder, destination) -> figures


def contenders(args: argparse.Namespace, source: Source) -> dict[str, Contender]:
    """Everything timed against `cp`, by label."""
    extra = list(args.convert_args)
    chosen: dict[str, Contender] = {
        "cp": run_cp,
        "convert": lambda src, dst: run_convert(None, src, dst, args.tp, args.pp, extra),
    }
    if args.before:
        before = Path(args.before).resolve()
        chosen["convert (before)"] = lambda src, dst: run_convert(
            before, src, dst, args.tp, args.pp, []
        )
    if args.least_work:
        # Only a plain folder's source files are hashed: the other layouts record theirs.
        chosen["least work"] = lambda src, dst: run_least_work(src, dst, src == source.folder)
    return chosen


def measure(args: argparse.Namespace, source: Source, root: Path) -> list[dict]:
    rows = []
    for cache in args.cache.split(","):
        for layout in args.layout.split(","):
            path = source.path(layout)
            best: dict[str, dict] = {}
            dropped = True
            for _ in range(args.repeat):  # take turns; keep the best of each
                for label, run in contenders(args, source).items():
                    dest = root / "dest"
                    shutil.rmtree(dest, ignore_errors=True)
                    dropped = prepare(cache, path) and dropped
                    fault_in(source.total + source.total // 4)
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    figures = run(path, dest)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    figures["cpu_seconds"] = (after.ru_utime - before.ru_utime) + (
                        after.ru_stime - before.ru_stime
                    )
                    if label not in best or figures["seconds"] < best[label]["seconds"]:
                        best[label] = figures
                    shutil.rmtree(dest, ignore_errors=True)
            cp = best["cp"]["seconds"]
            for label, figures in best.items():
                row = {"cache": cache if dropped else f"{cache}*", "layout": layout}
                row |= {"method": label, "seconds": figures["seconds"]}
                row |= {"gb_per_s": source.total / figures["seconds"] / 1e9}
                row |= {"throughput_vs_cp": cp / figures["seconds"]}
                row |= {"cpu_seconds": figures["cpu_seconds"]}
                if "read_bytes" in figures:
                    row |= {"read_bytes_over_source": figures["read_bytes"] / source.total}
                    row |= {"peak_rss_gb": figures["max_rss"] / 1e9}
                rows.append(row)
    return rows


def print_rows(rows: list[dict], source: Source, args: argparse.Namespace) -> None:
    gb = 1e9
    print(f"source {source.total / gb:.2f} GB, largest tensor {source.largest / gb:.2f} GB, "
          f"tp{args.tp} x pp{args.pp}, best of {args.repeat}; target: vs cp >= 0.8")  # fmt: skip
    print(f"{'cache':<6} {'layout':<7} {'method':<18} {'seconds':>8} {'GB/s':>6} "
          f"{'vs cp':>6} {'CPU s':>6} {'read/src':>9} {'RSS GB':>7}")  # fmt: skip
    for row in rows:
        read = f"{row['read_bytes_over_source']:>8.2f}x" if "read_bytes_over_source" in row else ""
        rss = f"{row['peak_rss_gb']:>7.2f}" if "peak_rss_gb" in row else ""
        speed, ratio, cpu = row["gb_per_s"], row["throughput_vs_cp"], row["cpu_seconds"]
        print(f"{row['cache']:<6} {row['layout']:<7} {row['method']:<18} {row['seconds']:>8.2f} "
              f"{speed:>6.2f} {ratio:>5.2f}x {cpu:>6.2f} {read:>9} {rss:>7}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GB")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cache", default="cold,warm", help="cold, warm or both")
    parser.add_argument("--layout", default="folder,local,hub", help="folder, local, hub")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", help="another shardprep checkout, timed side by side")
    parser.add_argument(
        "--least-work", action="store_true",
        help="also time the least work a conversion must do (copies and hashes only)",
    )  # fmt: skip
    parser.add_argument(
        "--convert-args", nargs=argparse.REMAINDER, default=[],
        help="extra flags for this checkout's `shardprep convert` (last on the line)",
    )  # fmt: skip
    parser.add_argument("--dir", default="bench-convert")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--plan-deepseek", action="store_true",
        help="time `shardprep plan` at DeepSeek-V3 scale instead (see bench_plan.py)",
    )  # fmt: skip
    args = parser.parse_args()
    root = Path(args.dir)
    if args.plan_deepseek:
        from bench_plan import bench_plan_deepseek_v3  # this script's folder is on sys.path

        bench_plan_deepseek_v3(root, args.tp, args.pp)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        return
    shutil.rmtree(root, ignore_errors=True)
    for checkout in (THIS_CHECKOUT, *([Path(args.before)] if args.before else [])):
        compile_bytecode(checkout)
    load_before = os.getloadavg()[0]
    try:
        source = build_source(root / "source", llama_config(parse_size(args.size)))
        rows = measure(args, source, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_rows(rows, source, args)
        print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
