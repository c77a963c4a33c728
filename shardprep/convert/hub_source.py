"""A Hugging Face Hub repo as a source checkpoint: planned from its metadata alone, then
only the files the plan reads are downloaded.

The revision is resolved once to a commit, which the manifest records. The commit's file
list gives each file's size and the sha256 the Hub states; config.json and the index are
downloaded into the Hugging Face cache, and each safetensors header is read by two range
requests and checked by the strict parser, so `plan` downloads no tensor byte. The
checkpoint's folder is the cache snapshot of that commit: a weight file appears there once
`start_fetch` has downloaded it (in parallel, its sha256 checked on arrival, while the
files before it are converted), where a
later `vllm serve` or `hf download` finds it too. With HF_HUB_OFFLINE=1 the cache snapshot
is read as a model folder, or the one error line says what it lacks.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, as_completed, wait
from pathlib import Path
from typing import TYPE_CHECKING

from shardprep.constants import COPIED_FILE_PATTERNS
from shardprep.convert.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    check_index,
    collect_tensors,
    is_repo_id_shape,
    load_config,
    open_checkpoint,
    read_index,
)
from shardprep.convert.hub_download import (
    Counter,
    cache_write_error,
    check_range_reads,
    download_into_cache,
    prune_stale_partials,
)
from shardprep.errors import ConfigError, ShardprepError, summarize
from shardprep.format.headers import parse_header
from shardprep.format.request import check_revision
from shardprep.plan import archs
from shardprep.plan.records import Plan
from shardprep.progress import Progress as tqdm

if TYPE_CHECKING:  # huggingface_hub takes a while to import; a local folder never needs it
    from shardprep import hub_client

HEADER_WORKERS = 8
# Few at a time, so that files arrive one after another in the order they are converted
# (with more, a shared link makes them all arrive at the end); see docs/benchmarks-history.md.
DOWNLOAD_WORKERS = 2


def open_source(
    model: str, revision: str | None = None, *, endpoint: str | None = None
) -> Checkpoint:
    """A model folder as it is, or a Hub repo id planned from its metadata."""
    if Path(model).expanduser().is_dir():
        return open_checkpoint(model)
    if not is_repo_id_shape(model):
        raise ConfigError(f"{model} is neither a model folder nor a Hugging Face repo id")
    from shardprep import hub_client

    hub_client.check_repo_id(model)
    if revision is not None:
        check_revision(revision)
    if hub_client.is_offline():
        return _offline(model, revision)
    # The metadata read here is small: no bar (a convert shows one for what it downloads).
    remote = hub_client.Remote(model, endpoint, progress=False)
    return open_hub_checkpoint(remote, revision or "main")


def open_hub_checkpoint(remote: hub_client.Remote, revision: str) -> Checkpoint:
    commit = remote.resolve(revision)
    where = f"{remote.repo_id}@{commit[:12]}"
    listing = remote.list_files(commit)
    if "config.json" not in listing:
        raise ConfigError(
            f"{where} has no config.json; point shardprep at a Hugging Face model repo"
        )
    # By the revision as given, so that the cache records which commit it names (as
    # huggingface_hub does) and an offline run or `vllm serve` finds the snapshot.
    root = remote.download_to_cache(revision, "config.json").parent
    if root.name != commit:
        raise ConfigError(
            f"{remote.repo_id}@{revision} moved from {commit[:12]} to {root.name[:12]} while "
            "shardprep read it; run again, or pin a commit with --revision"
        )
    config = dict(archs.read_config(load_config(root)))
    weight_map = None
    if INDEX_NAME in listing:
        remote.download_to_cache(commit, INDEX_NAME)
        weight_map = read_index(root / INDEX_NAME)
    files = _weight_files(remote, commit, listing, weight_map)
    with ThreadPoolExecutor(HEADER_WORKERS, thread_name_prefix="header") as pool:
        raw = dict(
            pool.map(lambda f: (f, remote.read_raw_header(commit, f, listing[f].size)), files)
        )
    headers = [(f, parse_header(raw[f], listing[f].size, f"{where}/{f}")) for f in files]
    tensors = collect_tensors(where, headers)
    check_index(root / INDEX_NAME, weight_map, tensors)
    return Checkpoint(
        root,
        config,
        tensors,
        tuple(files),
        remote.repo_id,
        commit,
        known_sha256={p: f.sha256 for p, f in listing.items() if f.sha256},
        sizes={p: f.size for p, f in listing.items()},
        remote=remote,
        range_reads={(f, 0, len(h)): hashlib.sha256(h).hexdigest() for f, h in raw.items()},
    )


def _weight_files(
    remote: hub_client.Remote,
    commit: str,
    listing: dict[str, hub_client.RemoteFile],
    weight_map: dict[str, str] | None,
) -> list[str]:
    where = f"{remote.repo_id}@{commit[:12]}"
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if f not in listing]
        if missing:
            raise ConfigError(
                f"{INDEX_NAME} of {where} names {summarize(missing)}, which the repo does not "
                "hold; its upload is incomplete: pick another revision (--revision)"
            )
        return files
    files = sorted(p for p in listing if p.endswith(".safetensors") and "/" not in p)
    if not files:
        raise ConfigError(
            f"{where} holds no *.safetensors files; shardprep reads safetensors checkpoints only"
        )
    return files


def _offline(repo_id: str, revision: str | None) -> Checkpoint:
    """The Hugging Face cache's snapshot of the revision, which must hold every weight
    file: the headers of the others cannot be read without the Hub."""
    from huggingface_hub import snapshot_download

    asked = f"{repo_id}@{revision or 'main'}"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # the client's "not in the cache" errors differ by version
        raise ConfigError(
            f"HF_HUB_OFFLINE is set and {asked} is not in the Hugging Face cache; unset "
            "HF_HUB_OFFLINE to read it from the Hub, or pass a model folder"
        ) from None
    index = folder / INDEX_NAME
    if index.is_file():
        missing = [f for f in sorted(set(read_index(index).values())) if not (folder / f).exists()]
        if missing:
            raise ConfigError(
                f"HF_HUB_OFFLINE is set and the Hugging Face cache holds only part of {asked} "
                f"(not {summarize(missing)}); unset HF_HUB_OFFLINE so that shardprep reads "
                "their headers from the Hub"
            )
    return open_checkpoint(folder, repo_id, folder.name)


def files_for_plan(plan: Plan, checkpoint: Checkpoint, roles: Iterable[str]) -> list[str]:
    """The source files of `checkpoint` that hold a tensor the plan writes for `roles`:
    every file when the plan covers every stage (a full convert hashes them all)."""
    roles = set(roles)
    if plan.stages == tuple(range(plan.topology.pp)):
        return list(checkpoint.files)
    wanted = {
        checkpoint.tensors[block.source].file
        for file in plan.files
        if file.role in roles
        for tensor in file.tensors
        for block in tensor.blocks
        if block.source is not None and block.source not in checkpoint.side_tensors
    }
    return sorted(wanted)


class Arrivals:
    """Downloads of a Hub source's files in flight, several at a time, in the order they
    were asked for: the converter waits for each file just before it reads it, so that
    converting overlaps downloading. With `progress`, one bar counts the bytes that have
    arrived (`expect` sets its total), beside the converter's. Closing cancels what has not
    started."""

    def __init__(self, progress: bool = False) -> None:
        self._pool = ThreadPoolExecutor(DOWNLOAD_WORKERS, thread_name_prefix="source")
        self._futures: dict[tuple[int, str], Future[None]] = {}
        self._progress = progress
        self._bar: tqdm | None = None
        self._counting = threading.Lock()

    def expect(self, batches: Iterable[tuple[Checkpoint, Iterable[str]]]) -> None:
        """Show the bytes of these files still to download (of Hub sources only)."""
        self.expect_bytes(
            sum(
                checkpoint.size(file)
                for checkpoint, files in batches
                if checkpoint.remote is not None
                for file in set(files)
                if not checkpoint.cached(file)
            )
        )

    def expect_bytes(self, total: int) -> None:
        if total and self._progress and self._bar is None:
            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="download")

    def count(self, n: int) -> None:
        """`n` more bytes have arrived (from any download thread)."""
        if self._bar is not None:
            with self._counting:
                self._bar.update(n)

    def submit(self, checkpoint: Checkpoint, files: Iterable[str]) -> None:
        remote, commit = checkpoint.remote, checkpoint.revision
        if remote is None or commit is None:
            return
        quiet = dataclasses.replace(remote, progress=False)  # this bar, not one per file
        for file in files:
            key = (id(checkpoint), file)
            if key not in self._futures:
                self._futures[key] = self._pool.submit(
                    _arrive, checkpoint, quiet, commit, file, self.count
                )

    def arrived(self, checkpoint: Checkpoint, files: list[str]) -> Iterator[list[str]]:
        """`files` of `checkpoint` in batches, each once it is here: first, together, those
        not being downloaded (all of a local source's, in order), then each download as
        it ends. A failed download is raised when it is reached."""
        pending = {}
        here = []
        for file in files:
            future = self._futures.get((id(checkpoint), file))
            if future is None:
                here.append(file)
            else:
                pending[future] = file
        if here:
            yield here
        for future in as_completed(pending):
            future.result()
            yield [pending[future]]

    def finish(self) -> None:
        """Until every download asked for is done; the first failure is raised."""
        pending = list(self._futures.values())
        done, _ = wait(pending, return_when=FIRST_EXCEPTION)
        for future in done:
            if future.exception() is not None:
                future.result()
        for future in pending:
            future.result()

    def close(self, *, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self._bar is not None:
            with self._counting:
                self._bar.close()


def start_fetch(
    plan: Plan, checkpoints: dict[str, Checkpoint], *, progress: bool = False
) -> Arrivals:
    """Start downloading what the plan reads of each Hub source, and the files copied
    beside the rank files (first: they are small), in the order the converter lays them
    out (it converts each as it arrives, and hashes each rank file in order). Partial
    downloads in the cache that nothing of the commit would resume go first."""
    distinct = distinct_sources(checkpoints)
    batches = [(cp, copied_files(cp)) for _, cp in distinct.values()]
    batches += [(cp, files_for_plan(plan, cp, roles)) for roles, cp in distinct.values()]
    for _, checkpoint in distinct.values():
        if checkpoint.remote is not None and checkpoint.known_sha256 is not None:
            prune_stale_partials(checkpoint.root.parent.parent, checkpoint.known_sha256.values())
    arrivals = Arrivals(progress)
    arrivals.expect(batches)
    for checkpoint, files in batches:
        arrivals.submit(checkpoint, files)
    return arrivals


def distinct_sources(checkpoints: dict[str, Checkpoint]) -> dict[int, tuple[list[str], Checkpoint]]:
    distinct: dict[int, tuple[list[str], Checkpoint]] = {}
    for role, checkpoint in checkpoints.items():
        roles, _ = distinct.get(id(checkpoint), ([], checkpoint))
        distinct[id(checkpoint)] = ([*roles, role], checkpoint)
    return distinct


def copied_files(checkpoint: Checkpoint) -> list[str]:
    return sorted(
        path
        for path in checkpoint.sizes or {}
        if "/" not in path and any(fnmatch.fnmatch(path, p) for p in COPIED_FILE_PATTERNS)
    )


def fetch(checkpoint: Checkpoint, files: Iterable[str]) -> None:
    """Download `files` of a Hub source into the Hugging Face cache and wait for them."""
    arrivals = Arrivals()
    try:
        arrivals.submit(checkpoint, files)
        arrivals.finish()
    finally:
        arrivals.close()


def _arrive(
    checkpoint: Checkpoint, remote: hub_client.Remote, commit: str, file: str, count: Counter
) -> None:
    """Download one file into the Hugging Face cache, unless it is there already. A weight
    file (the Hub states its sha256) resumes what a killed run left of it and must arrive
    with that sha256 (`hub_download.py`), and one already cached is used only when it is
    that blob; a small file stored in git is fetched whole. What the plan read of the file
    by range request (its header, a tensor) must be what arrived; a failure to write into
    the cache names the cache."""
    expected = (checkpoint.known_sha256 or {}).get(file)
    try:
        if expected is not None:
            download_into_cache(checkpoint, remote, commit, file, expected, count)
        elif not (checkpoint.root / file).exists():
            remote.download_to_cache(commit, file)
            count(checkpoint.size(file))
        check_planned_reads(checkpoint, remote, commit, file, checkpoint.root / file)
    except ShardprepError:
        raise
    except OSError as exc:  # the cache's disk, not the output folder's
        raise cache_write_error(checkpoint.root.parent.parent, exc) from exc


def check_planned_reads(
    checkpoint: Checkpoint, remote: hub_client.Remote, commit: str, file: str, path: Path
) -> None:
    """The bytes the plan read of `file` by range request must be those of `path`."""
    planned = {(o, n): d for (f, o, n), d in list(checkpoint.range_reads.items()) if f == file}
    if planned:
        check_range_reads(remote, commit, file, path, planned)
