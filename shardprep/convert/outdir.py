"""The output folder of a convert: one writer at a time, nothing half-written left behind.

The lock is `fcntl.flock` on `OUT/.shardprep-lock`, a file that names its holder (pid and
host) while it is held and is deleted on release. A second convert into the same folder
does not wait: it stops at once with one line naming the holder, as `apt` and `git` do,
because a user who started the same convert twice wants to know, not to wait an hour.
The kernel drops the lock when its holder dies, so a killed convert never blocks a rerun.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from shardprep.constants import (
    DRAFT_DIR,
    INCOMPLETE_SUFFIX,
    LOCK_NAME,
    MANIFEST_NAME,
    PARTIAL_MARKER,
    SHARDS_DIR,
    SOURCE_DOWNLOAD_DIR,
    SOURCE_PARTIAL_DIR,
)
from shardprep.errors import OutputExistsError, OutputLockedError, OutputWriteError


def prepare(out: Path) -> None:
    """Refuse an output path that is not (or cannot become) a folder; create it."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} is a file, not a folder; choose a folder for -o")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputWriteError(f"cannot create the output folder {out}: {_reason(exc)}") from None


def refuse_foreign(out: Path) -> None:
    """Refuse, before anything is downloaded or removed, a folder with neither a journal
    nor a manifest that holds more than shardprep itself leaves there: its lock, and a
    private source folder of its own shape (`partial/` and numbered source folders)."""
    if (out / PARTIAL_MARKER).is_file() or (out / MANIFEST_NAME).is_file():
        return
    if any(p.name != LOCK_NAME and not _own_source_folder(p) for p in out.iterdir()):
        raise OutputExistsError(
            f"{out} already holds files that are not a shardprep artifact; "
            "choose an empty or new output folder"
        )


def _own_source_folder(path: Path) -> bool:
    if path.name != SOURCE_DOWNLOAD_DIR or path.is_symlink() or not path.is_dir():
        return False
    return all(
        (p.name == SOURCE_PARTIAL_DIR or p.name.isdigit()) and p.is_dir() and not p.is_symlink()
        for p in path.iterdir()
    )


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold the exclusive lock on `out` (which must exist) for the body."""
    path = out / LOCK_NAME
    fd = _acquire(path, out)
    try:
        yield
    finally:
        # Unlink while still holding the lock: a process that opened the old file
        # meanwhile sees, once it gets the lock, that the name now points elsewhere.
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def _acquire(path: Path, out: Path) -> int:
    while True:
        try:
            # Never through a link: the holder's pid would be written into its target.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise OutputExistsError(
                f"{path} is a symbolic link, not shardprep's lock; remove it and rerun"
            ) from None
        if os.fstat(fd).st_nlink != 1 or not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputExistsError(
                f"{path} is not shardprep's lock (a hard link or not a regular file); "
                "remove it and rerun"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputLockedError(
                f"{out} is being written by another shardprep convert ({holder}); wait for it "
                "to finish (then rerun to check the result) or choose another output folder"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
            return fd
        os.close(fd)  # the holder released and deleted it in between: try the new one


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(holder['pid'])} on {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not recorded yet"


# Folders of an artifact that shardprep creates and writes into.
WRITTEN_FOLDERS = (SHARDS_DIR, DRAFT_DIR, f"{DRAFT_DIR}/{SHARDS_DIR}")
RANK_FOLDERS = (SHARDS_DIR, f"{DRAFT_DIR}/{SHARDS_DIR}")
_MANIFEST_TMP = re.compile(r"\.manifest-.*\.tmp")  # write_manifest's temporary name


def is_ours(out: Path) -> bool:
    """A folder that holds shardprep's journal or manifest is shardprep's to tidy."""
    return any((out / name).is_file() for name in (PARTIAL_MARKER, MANIFEST_NAME))


def remove_incomplete(out: Path) -> None:
    """Delete the temporary files a failed convert leaves (`*.incomplete`, a manifest's
    temporary name), in a folder that is shardprep's own (it holds a journal or a
    manifest); a folder of someone else's is never touched. A link is removed as a link:
    nothing it points to is touched, and no linked folder is entered."""
    if not is_ours(out):
        return
    for folder in (out, *(out / name for name in WRITTEN_FOLDERS)):
        for path in _entries(folder):
            ours = path.name.endswith(INCOMPLETE_SUFFIX) or _MANIFEST_TMP.fullmatch(path.name)
            if ours and (path.is_symlink() or path.is_file()):
                path.unlink(missing_ok=True)


def remove_unplanned(out: Path, planned: set[str]) -> list[str]:
    """Delete every file under the rank folders (`shards/`, `draft/shards/`) that the plan
    being written does not name: the rank files of an earlier plan (another
    --max-part-size, another topology) that a killed run left. Only in shardprep's own
    folder; returns the removed paths, relative to `out`."""
    if not is_ours(out):
        return []
    removed = []
    for name in RANK_FOLDERS:
        for path in _entries(out / name):
            rel = f"{name}/{path.name}"
            if rel not in planned and (path.is_symlink() or path.is_file()):
                path.unlink(missing_ok=True)
                removed.append(rel)
    return removed


def _entries(folder: Path) -> list[Path]:
    """The entries of a real folder (not of a link to one); none when it is absent."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(folder.iterdir())


def file_id(path: Path) -> tuple[int, int, int] | None:
    """Changes when a file is rewritten (a new file is renamed over it)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def write_error(out: Path, exc: OSError) -> OutputWriteError:
    """An OSError while writing the artifact, as one line that says what to do."""
    where = f" ({exc.filename})" if exc.filename else ""
    hint = {
        errno.ENOSPC: "free some space",
        errno.EDQUOT: "free some space or raise the quota",
        errno.EFBIG: "the file system or a limit (ulimit -f) refuses files this large; "
        "lower --max-part-size or raise the limit",
        errno.EACCES: "check the permissions of the output folder",
        errno.EROFS: "choose a writable output folder",
    }.get(exc.errno or 0, "fix the cause")
    return OutputWriteError(
        f"convert to {out} failed: {_reason(exc)}{where}; {hint}, then rerun the same "
        "command to resume"
    )


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)
