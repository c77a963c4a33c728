"""Converting from a Hub repo, side by side with downloading alone, through the test Hub
(tests/support/hub_server.py) with its bandwidth capped.

    python scripts/bench_hub_source.py [--size 2GB] [--files 8] [--bandwidth 200MB]
                                       [--tp 2] [--pp 2 --stage 1] [--source-budget SIZE]
                                       [--timeline] [--dir DIR] [--json]

Builds a synthetic Llama-shaped bf16 checkpoint of about SIZE in FILES layer-contiguous
files, publishes it on a local test Hub that sends file bodies at BANDWIDTH bytes per
second (all connections together), then, each in a fresh Hugging Face cache:

- `download`: huggingface_hub's `snapshot_download` of the files the plan reads (its own
  parallel downloader, no shardprep): the floor;
- `download, then convert`: the same download, then `convert` of the repo id (which finds
  the files in the cache);
- `convert while downloading`: `convert` of the repo id alone, which downloads the files
  (two at a time, in the order it lays them out, each hashed as it arrives) and converts
  each once it has arrived;
- the same with `--source-budget` (default: the two largest files read), with the peak
  bytes of source files on disk (sampled whenever a download starts or ends and before a
  converted file is deleted).

Wall times are given as a ratio to `download` (the goal is at most 1.1 for converting while
downloading). The `plan` row is `shardprep plan` of the repo id: its time and the bytes the
Hub sent (headers by range request only). `--timeline` shows, for each convert, when each
file arrived and when its conversion ended, and when every rank file was written and
hashed. Numbers on a shared machine are noisy: quote ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.pop("HF_HUB_OFFLINE", None)
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "scripts")]

from bench_convert import write_checkpoint  # noqa: E402
from hub_server import HubServer  # noqa: E402
from huggingface_hub import HfApi, constants, snapshot_download  # noqa: E402

from shardprep.cli.sizes import parse_size  # noqa: E402
from shardprep.constants import SOURCE_DOWNLOAD_DIR  # noqa: E402
from shardprep.convert import hub_budget, hub_source, run, scatter  # noqa: E402
from shardprep.convert.hub_source import files_for_plan  # noqa: E402
from shardprep.convert.run import Options, convert, load_and_plan  # noqa: E402

REPO = "bench/synthetic"


def serve(storage: Path, bandwidth: float, names: list[str], conn: object) -> None:
    """The test Hub in its own process (in this one it would share the interpreter lock
    with the client it measures); answers each request with the bytes sent so far."""
    with HubServer(storage, bandwidth=bandwidth) as hub:
        conn.send(hub.endpoint)  # type: ignore[attr-defined]
        while conn.recv() == "sent":  # type: ignore[attr-defined]
            conn.send(sum(hub.bytes_served(REPO, name) for name in names))  # type: ignore[attr-defined]


def fresh_cache(root: Path, name: str) -> None:
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    constants.HF_HUB_CACHE = str(folder)


def timed(run: object) -> float:
    start = time.perf_counter()
    run()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GB", help="checkpoint size (default: 2GB)")
    parser.add_argument("--files", type=int, default=8, help="safetensors files (default: 8)")
    parser.add_argument("--bandwidth", default="200MB", help="bytes per second (default: 200MB)")
    parser.add_argument(
        "--workers", type=int, help="parallel downloads of convert (default: shardprep's)"
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--stage", type=int, help="convert only this stage")
    parser.add_argument(
        "--source-budget",
        help="also convert while downloading within this --source-budget, and report the "
        "peak bytes of source on disk (default: two of the files read)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print when each file arrived and when its conversion ended, for each convert",
    )
    parser.add_argument("--dir", help="work folder (default: a temporary one, deleted)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.workers:
        hub_source.DOWNLOAD_WORKERS = args.workers
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-hub-"))
    constants.HF_HOME = str(work / "hf-home")
    try:
        rows = measure(args, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    floor = next(r["seconds"] for r in rows if r["what"] == "download")
    for row in rows:
        ratio = f"{row['seconds'] / floor:5.2f}x" if row["what"] != "plan" else "      "
        sent = f"  {row['sent_bytes']:>14,} B sent" if "sent_bytes" in row else ""
        peak = f"  peak source on disk {row['peak_bytes']:,} B" if "peak_bytes" in row else ""
        print(f"{row['what']:<40} {row['seconds']:8.2f} s  {ratio}{sent}{peak}")
        for file, arrived, converted in row.get("timeline", []) if args.timeline else []:
            print(f"    {file}  arrived {arrived:7.2f} s  converted {converted:7.2f} s")


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    total, _ = write_checkpoint(work / "model", parse_size(args.size), args.files)
    bandwidth = float(parse_size(args.bandwidth))
    with HubServer(work / "hub") as uploader:  # unthrottled, in this process: the upload
        api = HfApi(endpoint=uploader.endpoint)
        api.create_repo(REPO)
        api.upload_folder(repo_id=REPO, folder_path=work / "model")
    names = [p.name for p in (work / "model").iterdir()]
    parent, child = multiprocessing.Pipe()
    server = multiprocessing.get_context("spawn").Process(
        target=serve, args=(work / "hub", bandwidth, names, child), daemon=True
    )
    server.start()
    try:
        return _measure(args, work, total, bandwidth, parent)
    finally:
        parent.send("stop")
        server.join(timeout=10)


def _measure(
    args: argparse.Namespace, work: Path, total: int, bandwidth: float, hub: object
) -> list[dict]:
    endpoint = hub.recv()  # type: ignore[attr-defined]

    def sent() -> int:
        hub.send("sent")  # type: ignore[attr-defined]
        return hub.recv()  # type: ignore[attr-defined]

    options = Options(tp=args.tp, pp=args.pp, stage=args.stage, endpoint=endpoint)

    fresh_cache(work, "cache-plan")
    before = sent()
    plan_box: list = []
    plan_s = timed(lambda: plan_box.append(load_and_plan(REPO, options)))
    plan, checkpoints = plan_box[0]
    plan_sent = sent() - before
    wanted = files_for_plan(plan, checkpoints["target"], ["target"])
    patterns = [*wanted, "*.json"]
    print(
        f"{total:,} bytes in {args.files} files, {len(wanted)} read by the plan; "
        f"bandwidth {bandwidth:,.0f} B/s",
        file=sys.stderr,
    )

    def download() -> None:
        snapshot_download(REPO, allow_patterns=patterns, endpoint=endpoint)

    def convert_into(name: str) -> None:
        convert(REPO, work / name, options, progress=False)

    sizes = checkpoints["target"].sizes or {}
    budget = (
        parse_size(args.source_budget)
        if args.source_budget
        else sum(sorted(sizes[f] for f in wanted)[-2:])
    )
    rows = [{"what": "plan", "seconds": plan_s, "sent_bytes": plan_sent}]
    fresh_cache(work, "cache-a")
    rows.append({"what": "download", "seconds": timed(download)})
    fresh_cache(work, "cache-b")
    then = timed(download) + timed(lambda: convert_into("out-b"))
    rows.append({"what": "download, then convert", "seconds": then})
    fresh_cache(work, "cache-c")
    with Timeline() as timeline:
        seconds = timed(lambda: convert_into("out-c"))
    rows.append(
        {"what": "convert while downloading", "seconds": seconds, "timeline": timeline.rows()}
    )
    fresh_cache(work, "cache-d")
    private = work / "out-d" / SOURCE_DOWNLOAD_DIR
    peaks = [0]

    def watch() -> None:
        files = [p for p in private.rglob("*") if p.is_file() and not p.is_symlink()]
        peaks.append(sum(p.lstat().st_size for p in files))  # links to the cache not counted

    budgeted = dataclasses.replace(options, source_budget=budget)
    with Timeline() as timeline:
        seconds = timed(
            lambda: convert(REPO, work / "out-d", budgeted, progress=False, source_watch=watch)
        )
    rows.append(
        {
            "what": f"convert while downloading, budget {budget:,} B",
            "seconds": seconds,
            "peak_bytes": max(peaks),
            "timeline": timeline.rows(),
        }
    )
    for name in ("cache-a", "cache-b", "cache-c", "cache-d", "out-b", "out-c", "out-d"):
        shutil.rmtree(work / name, ignore_errors=True)
    return rows


class Timeline:
    """When each source file arrived (its download ended) and when its conversion ended,
    in seconds from the start; while it is entered, the download and the scatter of a
    file are wrapped to note the time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrived: dict[str, float] = {}
        self.converted: dict[str, float] = {}

    def __enter__(self) -> Timeline:
        self.saved = (hub_source.download_into_cache, hub_budget.download_resumable)
        self.scatter = scatter._scatter_file
        self.write = run.write_rank_files

        def arrive(download):  # type: ignore[no-untyped-def]
            def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                download(*args, **kwargs)
                file = next(a for a in args if isinstance(a, str) and a.endswith(".safetensors"))
                self.arrived[file] = time.perf_counter() - self.start

            return run

        def convert_file(*args, **kwargs):  # type: ignore[no-untyped-def]
            digest = self.scatter(*args, **kwargs)
            self.converted[args[4]] = time.perf_counter() - self.start
            return digest

        def write(*args, **kwargs):  # type: ignore[no-untyped-def]
            hashes = self.write(*args, **kwargs)
            self.converted["(every rank file written and hashed)"] = (
                time.perf_counter() - self.start
            )
            return hashes

        run.write_rank_files = write
        hub_source.download_into_cache = arrive(hub_source.download_into_cache)
        hub_budget.download_resumable = arrive(hub_budget.download_resumable)
        scatter._scatter_file = convert_file
        return self

    def __exit__(self, *exc: object) -> None:
        hub_source.download_into_cache, hub_budget.download_resumable = self.saved
        scatter._scatter_file = self.scatter
        run.write_rank_files = self.write

    def rows(self) -> list[tuple[str, float, float]]:
        return [
            (file, self.arrived.get(file, 0.0), self.converted.get(file, 0.0))
            for file in sorted(self.converted)
        ]


if __name__ == "__main__":
    main()
