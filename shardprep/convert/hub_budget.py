"""`convert --source-budget`: a Hub source's weight files downloaded into a private
folder instead of the Hugging Face cache, each deleted once every tensor in it is written,
never more than the budget of them on disk at once.

A file being downloaded is `partial/<sha256>.incomplete` in the private folder, and a
convert that fails or is killed leaves those (only those): the rerun resumes each that its
plan reads and counts their bytes in the budget from the start."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from shardprep.constants import INCOMPLETE_SUFFIX, SOURCE_PARTIAL_DIR
from shardprep.convert.checkpoint import Checkpoint, local_dir_metadata_path
from shardprep.convert.hub_download import download_resumable, partial_path
from shardprep.convert.hub_source import (
    Arrivals,
    check_planned_reads,
    copied_files,
    distinct_sources,
    files_for_plan,
    start_fetch,
)
from shardprep.errors import ConfigError
from shardprep.plan.records import Plan


class BudgetedArrivals(Arrivals):
    """Downloads of Hub source weight files into a private folder, never more than
    `budget` bytes of them there at once: a download waits until the files converted
    before it are deleted (`release`). `watch` is called whenever a download starts or
    ends and before a file is deleted (the moments the folder's size peaks)."""

    def __init__(
        self,
        budget: int,
        watch: Callable[[], None] | None = None,
        *,
        progress: bool = False,
        partials: Path | None = None,
        kept: dict[str, int] | None = None,
    ) -> None:
        """`partials`: the folder of partial downloads; `kept`: the bytes a killed run
        left there of each file (by sha256), on disk already and so in the budget."""
        super().__init__(progress)
        self.budget = budget
        self.watch = watch or (lambda: None)
        self.partials = partials
        self._kept = dict(kept or {})
        self._room = threading.Condition()
        self._held = sum(self._kept.values())
        self._closed = False
        self._paths: dict[tuple[int, str], tuple[list[Path], int]] = {}

    def submit_private(self, checkpoint: Checkpoint, files: Iterable[str]) -> None:
        for file in files:
            key = (id(checkpoint), file)
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._arrive_private, checkpoint, file)

    def _arrive_private(self, checkpoint: Checkpoint, file: str) -> None:
        size = checkpoint.size(file)
        expected = (checkpoint.known_sha256 or {}).get(file)
        with self._room:
            kept = self._kept.pop(expected, 0) if expected else 0
            more = size - kept
            self._room.wait_for(lambda: self._closed or self._held + more <= self.budget)
            if self._closed:
                return
            self._held += more
        self.watch()
        remote, commit = checkpoint.remote, checkpoint.revision
        assert remote is not None and commit is not None
        path = checkpoint.root / file
        partial = (
            self.partials / f"{expected}{INCOMPLETE_SUFFIX}"
            if self.partials is not None and expected
            else partial_path(path)
        )
        self._paths[(id(checkpoint), file)] = ([path, partial], size)
        if expected is None:  # a weight file stored in git: no sha256 to resume against
            remote.download(commit, file, checkpoint.root)
            self._paths[(id(checkpoint), file)][0].append(
                local_dir_metadata_path(checkpoint.root, file)
            )
            self.count(size)
        else:  # checked against the Hub's sha256 as it arrives; a mismatch is deleted
            download_resumable(
                remote, commit, file, size, expected, path, self.count, partial=partial
            )
        check_planned_reads(checkpoint, remote, commit, file, path)
        self.watch()

    def release(self, checkpoint: Checkpoint, file: str) -> None:
        """`file` of `checkpoint` is converted: delete it, making room for the next."""
        held = self._paths.pop((id(checkpoint), file), None)
        if held is None:
            return
        self.watch()
        for path in held[0]:
            path.unlink(missing_ok=True)
        with self._room:
            self._held -= held[1]
            self._room.notify_all()

    def close(self, *, wait: bool = True) -> None:
        with self._room:
            self._closed = True
            self._room.notify_all()
        super().close(wait=wait)


def start_budgeted_fetch(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    folder: Path,
    budget: int,
    watch: Callable[[], None] | None = None,
    *,
    progress: bool = False,
) -> tuple[BudgetedArrivals, dict[str, Checkpoint]]:
    """Like `start_fetch`, but each Hub source's weight files go into its own subfolder
    of `folder` (not the Hugging Face cache) within `budget`; the checkpoints returned
    read them there. The small files (config, tokenizer, side files) stay in the cache
    and are linked into the subfolder."""
    distinct = distinct_sources(checkpoints)
    wanted = {
        key: files_for_plan(plan, cp, roles) if cp.remote else []
        for key, (roles, cp) in distinct.items()
    }
    for key, (_, checkpoint) in distinct.items():
        for file in wanted[key]:
            if checkpoint.size(file) > budget:
                raise ConfigError(
                    f"--source-budget {budget} bytes is smaller than {file} of "
                    f"{checkpoint.repo_id} ({checkpoint.size(file)} bytes); give a budget of "
                    "at least its size, or leave --source-budget out"
                )
    weights = [(cp, f) for key, (_, cp) in distinct.items() for f in wanted[key]]
    partials = folder / SOURCE_PARTIAL_DIR
    kept = resumable_partials(partials, weights, budget)
    arrivals = BudgetedArrivals(budget, watch, progress=progress, partials=partials, kept=kept)
    small = [(cp, f) for _, cp in distinct.values() if cp.remote for f in copied_files(cp)]
    arrivals.expect_bytes(
        sum(cp.size(f) for cp, f in weights)
        + sum(cp.size(f) for cp, f in small if not (cp.root / f).exists())
    )
    private: dict[int, Checkpoint] = {}
    for n, (key, (_, checkpoint)) in enumerate(distinct.items()):
        if checkpoint.remote is None:
            private[key] = checkpoint
            continue
        arrivals.submit(checkpoint, copied_files(checkpoint))
        arrivals.finish()  # the small files first, into the cache
        root = folder / str(n)
        root.mkdir(parents=True, exist_ok=True)
        for name in sorted(p.name for p in checkpoint.root.iterdir()):
            if name not in checkpoint.files:
                (root / name).symlink_to((checkpoint.root / name).resolve())
        private[key] = dataclasses.replace(checkpoint, root=root)
    for key, checkpoint in private.items():
        if checkpoint.remote is not None:
            arrivals.submit_private(checkpoint, wanted[key])
    return arrivals, {role: private[id(cp)] for role, cp in checkpoints.items()}


def begin_fetch(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    private: Path,
    budget: int | None,
    watch: Callable[[], None] | None = None,
    *,
    progress: bool = False,
) -> tuple[Arrivals, dict[str, Checkpoint]]:
    """`start_fetch`, or with a budget `start_budgeted_fetch` into `private` (emptied
    first of what a killed run left). `progress`: a bar of the bytes downloaded."""
    if budget is None:
        return start_fetch(plan, checkpoints, progress=progress), checkpoints
    prune_private(private)
    return start_budgeted_fetch(plan, checkpoints, private, budget, watch, progress=progress)


def remove_private(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def prune_private(folder: Path) -> None:
    """Empty the private folder of all but its partial downloads (a rerun resumes them)."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        folder.unlink()
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.name == SOURCE_PARTIAL_DIR and child.is_dir() and not child.is_symlink():
            for path in child.iterdir():
                if not (path.name.endswith(INCOMPLETE_SUFFIX) and path.is_file()):
                    _remove(path)
            continue
        _remove(child)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def resumable_partials(
    partials: Path, weights: list[tuple[Checkpoint, str]], budget: int
) -> dict[str, int]:
    """sha256 -> bytes of each partial download a failed or killed run left that this plan
    reads; the others are deleted, and so are all of them when they would leave no room
    within `budget` for the largest file (they are downloaded again)."""
    wanted = {(cp.known_sha256 or {}).get(f) for cp, f in weights}
    kept = {}
    for path in partials.glob(f"*{INCOMPLETE_SUFFIX}"):
        name = path.name[: -len(INCOMPLETE_SUFFIX)]
        if name in wanted and path.is_file() and not path.is_symlink():
            kept[name] = path.stat().st_size
    largest = max((cp.size(f) for cp, f in weights), default=0)
    if sum(kept.values()) + largest > budget:
        kept = {}
    for path in partials.glob(f"*{INCOMPLETE_SUFFIX}"):
        if path.name[: -len(INCOMPLETE_SUFFIX)] not in kept:
            path.unlink(missing_ok=True)
    partials.mkdir(parents=True, exist_ok=True)
    return kept
