"""What the stage-sharded cache keeps about itself under `.shardprep/`: which part a fetch
asks for, completion markers, per-stage locks, and atomic writes (see cache.py)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from shardprep import safefs
from shardprep.constants import MANIFEST_NAME, STATE_DIR

logger = logging.getLogger("shardprep.hub.cache")


@dataclass(frozen=True)
class Part:
    """What one fetch asks for: a stage, or one tensor parallel rank of it."""

    stage: int
    rank: int | None = None

    @property
    def key(self) -> str:
        return f"stage-{self.stage}" + ("" if self.rank is None else f"-rank-{self.rank}")

    def __str__(self) -> str:
        return f"stage {self.stage}" + ("" if self.rank is None else f" rank {self.rank}")


@dataclass(frozen=True)
class Wanted:
    """One file of a part: where its plain bytes go, and what the repo stores."""

    path: str
    bytes: int
    sha256: str
    stored: str
    stored_bytes: int
    stored_sha256: str
    codec: str


def marker_path(folder: Path, part: Part) -> Path:
    return folder / STATE_DIR / "done" / f"{part.key}.json"


def is_complete(folder: Path, part: Part) -> bool:
    """The part's marker (or its whole stage's) exists and its files are all in place."""
    candidates = [part] if part.rank is None else [Part(part.stage), part]
    if not (folder / MANIFEST_NAME).is_file():
        return False
    for candidate in candidates:
        marker = marker_path(folder, candidate)
        if marker.is_file():
            try:
                files = json.loads(marker.read_text())["files"]
                sizes = {str(p): int(n) for p, n in files.items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a damaged marker: the part is fetched again (files in place stay)
            if all(
                (folder / p).is_file() and (folder / p).stat().st_size == n
                for p, n in sizes.items()
            ):
                return True
    return False


def write_marker(folder: Path, part: Part, wanted: list[Wanted]) -> None:
    files = {w.path: w.bytes for w in wanted}
    record = {"stage": part.stage, "rank": part.rank, "commit": folder.name, "files": files}
    write_atomic(marker_path(folder, part), json.dumps(record, indent=1, sort_keys=True) + "\n")


@contextmanager
def fetch_lock(folder: Path, name: str, what: str, progress: bool) -> Iterator[None]:
    """One process of a node fetches `what`; the others wait here, then find it complete."""
    path = folder / STATE_DIR / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        message = f"another process is fetching {what} into {folder}; waiting for it"
        logger.info(message)
        if progress:
            print(f"shardprep: {message}", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def write_atomic(path: Path, text: str) -> None:
    """A unique temporary name, then a rename: concurrent writers never mix their bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    safefs.write_atomic(path, text)  # the umask's mode, as every file of the cache
