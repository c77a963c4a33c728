"""A weight file of a Hub source downloaded so that a killed run resumes it.

huggingface_hub downloads into a file named for the one download
(`<etag>.<random>.incomplete`) and deletes it when that download fails, so a convert killed
in the middle of a file would fetch the whole file again. Here a weight file goes into
`<name>.incomplete` beside its final name, written through to the system as each block
arrives: a run killed at any moment leaves the bytes it received, and the next run hashes
them and asks for the rest with a range request (`bytes=N-`), as huggingface_hub does when a
connection drops within one download. The sha256 is computed as the bytes arrive (the file
is never read again to hash it) and must be the one the Hub states before the file takes
its final name.

In the Hugging Face cache the final name is the blob named by that sha256, written under
the lock huggingface_hub takes for it, and linked into the commit's snapshot here as
huggingface_hub links a blob it downloaded itself (`snapshots/<commit>/<file>` ->
`../../blobs/<sha256>`), so a later `vllm serve` finds it. The server is not asked again:
another answer (a HEAD naming another etag) would make huggingface_hub fetch a second body,
unchecked, and point the snapshot at it. A snapshot file found already cached is used only
when it is that blob; anything else at its name is replaced by it.

No write follows a link: the partial download is opened with `O_NOFOLLOW` (a link planted at
its predictable name is removed, never written through), the blob takes its name by a rename
and the snapshot's link by a rename of a new link.

A partial download that no file of the commit being converted would resume (one of a
commit no longer wanted) is deleted before the downloads start, unless another process
holds its lock.

Once a file is here, and before any of it is converted, its header bytes (and any tensor the
plan read before the file was here) must be the ones the plan was made from, read by range
request: a server answering range reads with other bytes of the same length would
otherwise have the rank files read at the wrong offsets.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from shardprep.constants import INCOMPLETE_SUFFIX
from shardprep.errors import CorruptFileError, HubError, OutputWriteError

if TYPE_CHECKING:
    from shardprep import hub_client
    from shardprep.convert.checkpoint import Checkpoint

RETRIES = 5  # dropped connections in a row, with no byte received between them
RETRY_PAUSE_S = 1.0
HASH_BLOCK = 16 * 1024**2
_SHA256 = re.compile(r"[0-9a-f]{64}")

Counter = Callable[[int], None]


def partial_path(final: Path) -> Path:
    return final.with_name(final.name + INCOMPLETE_SUFFIX)


def download_resumable(
    remote: hub_client.Remote,
    commit: str,
    file: str,
    size: int,
    sha256: str,
    final: Path,
    count: Counter | None = None,
    *,
    partial: Path | None = None,
) -> None:
    """`file` of `commit` into `final`, continuing what `partial` (default:
    `final.incomplete`) holds. `count(n)` is told of each n bytes that are here (those
    kept from before included)."""
    from shardprep.hub_client import is_connection_error

    count = count or (lambda n: None)
    partial = partial or partial_path(final)
    partial.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(_open_partial(partial), "a+b") as handle:
        digest, have = _kept(handle, size)
        count(have)
        failures = 0
        while have < size:
            try:
                with remote.body(commit, file, have) as (offset, blocks):
                    if offset != have:  # the server sent the whole file: start again
                        handle.truncate(0)
                        count(-have)
                        digest, have = hashlib.sha256(), 0
                    for block in blocks:
                        if have + len(block) > size:
                            raise _wrong_size(remote, commit, file, size)
                        handle.write(block)
                        handle.flush()  # a kill at any moment keeps what arrived
                        digest.update(block)
                        have += len(block)
                        count(len(block))
                        failures = 0
            except HubError as exc:
                if not is_connection_error(exc.__cause__ or exc) or failures >= RETRIES:
                    raise
                failures += 1
                time.sleep(RETRY_PAUSE_S)
                continue
            if have < size:  # the body ended early without an error
                failures += 1
                if failures > RETRIES:
                    raise _wrong_size(remote, commit, file, size)
    found = digest.hexdigest()
    if found != sha256:
        partial.unlink(missing_ok=True)
        raise wrong_sha256(remote, commit, file, found, sha256, final, "deleted")
    os.replace(partial, final)


def _open_partial(partial: Path) -> int:
    """The partial download, opened for appending without following a link: a link (or
    anything but a plain file) at its name is removed, its target untouched, and the name
    opened again."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(partial, flags, 0o666)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            partial.unlink()
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        partial.unlink()
    raise CorruptFileError(
        f"{partial} was replaced again and again while shardprep opened it; stop whatever "
        "writes there and run again",
        path=str(partial),
    )


def _kept(handle: BinaryIO, size: int) -> tuple[hashlib._Hash, int]:
    """The sha256 of the bytes a killed run left (hashed once, here) and their count."""
    digest = hashlib.sha256()
    kept = os.fstat(handle.fileno()).st_size
    if kept > size:
        handle.truncate(0)
        return digest, 0
    handle.seek(0)
    while block := handle.read(HASH_BLOCK):
        digest.update(block)
    return digest, kept


def download_into_cache(
    checkpoint: Checkpoint,
    remote: hub_client.Remote,
    commit: str,
    file: str,
    sha256: str,
    count: Counter | None = None,
) -> None:
    """A weight file of a Hub source into the Hugging Face cache (its blob, then the link
    from the commit's snapshot), resuming what a killed run left of it; a snapshot file
    already there is kept only when it is that blob."""
    from filelock import FileLock

    storage = checkpoint.root.parent.parent  # models--org--name, above snapshots/<commit>
    blob = storage / "blobs" / sha256
    size = checkpoint.size(file)
    if _is_blob(blob, size) and _links_to(checkpoint.root / file, blob):
        return
    if not _is_blob(blob, size):
        lock = storage.parent / ".locks" / storage.name / f"{sha256}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):  # the lock huggingface_hub holds while it writes this blob
            if not _is_blob(blob, size):
                download_resumable(remote, commit, file, size, sha256, blob, count)
    link_snapshot(checkpoint.root / file, blob)


def prune_stale_partials(storage: Path, wanted: Iterable[str]) -> None:
    """Delete the partial downloads in the repo's `blobs/` that no file of the commit being
    converted would resume (those of a commit no longer wanted), except one that another
    process is writing (it holds the blob's lock)."""
    from filelock import FileLock, Timeout

    keep = set(wanted)
    for path in sorted((storage / "blobs").glob(f"*{INCOMPLETE_SUFFIX}")):
        sha256 = path.name[: -len(INCOMPLETE_SUFFIX)]
        if not _SHA256.fullmatch(sha256) or sha256 in keep:
            continue  # huggingface_hub's own names carry a random part: not ours
        lock = storage.parent / ".locks" / storage.name / f"{sha256}.lock"
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(lock, timeout=0):
                path.unlink(missing_ok=True)
        except (Timeout, OSError):  # being written, or not ours to remove: left as it is
            continue


def _is_blob(blob: Path, size: int) -> bool:
    """A plain file (not a link) of the size the Hub lists, at the name of its sha256."""
    try:
        info = os.lstat(blob)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == size


def _links_to(path: Path, blob: Path) -> bool:
    return path.is_symlink() and os.path.realpath(path) == os.path.realpath(blob)


def link_snapshot(path: Path, blob: Path) -> None:
    """`path` (in a snapshot) becomes a relative link to `blob`, as huggingface_hub makes
    it; whatever stood at that name is replaced (by a rename), never written through."""
    path.parent.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(os.path.abspath(blob), os.path.abspath(path.parent))
    new = path.with_name(f".{path.name}.{secrets.token_hex(6)}{INCOMPLETE_SUFFIX}")
    os.symlink(target, new)
    try:
        os.replace(new, path)
    except BaseException:
        new.unlink(missing_ok=True)
        raise


def check_range_reads(
    remote: hub_client.Remote,
    commit: str,
    file: str,
    path: Path,
    planned: dict[tuple[int, int], str],
) -> None:
    """The file that arrived at `path` must hold the bytes the plan read by range request:
    `planned` maps (offset, length) to their sha256 (its header at offset 0)."""
    with open(path, "rb") as handle:
        for (offset, length), expected in sorted(planned.items()):
            found = hashlib.sha256(os.pread(handle.fileno(), length, offset)).hexdigest()
            if found == expected:
                continue
            what = "another header" if offset == 0 else f"other bytes at {offset:,}"
            raise HubError(
                f"{remote.repo_id}@{commit[:12]}/{file} arrived with {what} than "
                f"{remote.where} sent for its range reads, from which the plan was made; "
                "nothing of it was converted. The server answers range requests with other "
                "bytes: check HF_ENDPOINT, or download the model and pass its folder"
            )


def _wrong_size(remote: hub_client.Remote, commit: str, file: str, size: int) -> HubError:
    return HubError(
        f"{remote.where} sent {remote.repo_id}@{commit[:12]}/{file} with another size than "
        f"the {size:,} bytes it lists; run again, and if it fails again check HF_ENDPOINT"
    )


def wrong_sha256(
    remote: hub_client.Remote,
    commit: str,
    file: str,
    found: str | None,
    expected: str,
    path: Path,
    done: str,
) -> CorruptFileError:
    return CorruptFileError(
        f"{remote.repo_id}@{commit[:12]}: {file} arrived with sha256 {found}, not the "
        f"{expected} the Hub states; it was {done} and nothing was converted: run again, "
        "and if it fails again the repo's copy is damaged",
        path=str(path),
    )


def cache_write_error(storage: Path, exc: OSError) -> OutputWriteError:
    """An OSError in the Hugging Face cache, as one line that names the cache (not the
    output folder) and says what to do."""
    where = f" ({exc.filename})" if exc.filename else ""
    hint = {
        errno.ENOSPC: "free some space there",
        errno.EDQUOT: "free some space there or raise the quota",
        errno.EFBIG: "the file system or a limit (ulimit -f) refuses a file this large",
        errno.EACCES: "check its permissions",
        errno.EROFS: "it is read-only",
    }.get(exc.errno or 0, "fix the cause")
    return OutputWriteError(
        f"writing the source into the Hugging Face cache ({storage}) failed: "
        f"{exc.strerror or exc}{where}; {hint}, point HF_HUB_CACHE at another disk, or "
        "convert with --source-budget (the source then goes into the output folder), then "
        "rerun the same command to resume"
    )
