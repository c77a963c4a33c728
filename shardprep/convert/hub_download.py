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
the lock huggingface_hub takes for it; huggingface_hub then links it into the commit's
snapshot as it does a blob it downloaded itself, so a later `vllm serve` finds it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shardprep.constants import INCOMPLETE_SUFFIX
from shardprep.errors import CorruptFileError, HubError

if TYPE_CHECKING:
    from shardprep import hub_client
    from shardprep.convert.checkpoint import Checkpoint

RETRIES = 5  # dropped connections in a row, with no byte received between them
RETRY_PAUSE_S = 1.0
HASH_BLOCK = 16 * 1024**2

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
    digest, have = _kept(partial, size)
    count(have)
    failures = 0
    with open(partial, "ab") as handle:
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


def _kept(partial: Path, size: int) -> tuple[hashlib._Hash, int]:
    """The sha256 of the bytes a killed run left (hashed once, here) and their count."""
    digest = hashlib.sha256()
    try:
        kept = partial.stat().st_size
    except FileNotFoundError:
        return digest, 0
    if kept > size:
        partial.unlink()
        return digest, 0
    with open(partial, "rb") as handle:
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
    from the commit's snapshot), resuming what a killed run left of it."""
    from filelock import FileLock

    storage = checkpoint.root.parent.parent  # models--org--name, above snapshots/<commit>
    blob = storage / "blobs" / sha256
    if not blob.exists():
        lock = storage.parent / ".locks" / storage.name / f"{sha256}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):  # the lock huggingface_hub holds while it writes this blob
            if not blob.exists():
                size = checkpoint.size(file)
                download_resumable(remote, commit, file, size, sha256, blob, count)
    remote.download_to_cache(commit, file)  # finds the blob and links it: no body sent


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
