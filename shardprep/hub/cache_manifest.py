"""Which commit a fetch serves, and its manifest: a revision resolves through the Hub, or
through `refs/` when the Hub is not used; the manifest is downloaded once per commit,
checked against the id the Hub gives it, and placed at the folder's root once a first
part is complete."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path, PurePosixPath

from shardprep import hub_client
from shardprep.constants import FETCHED_MANIFEST, MANIFEST_NAME
from shardprep.errors import ConfigError, CorruptFileError, HubError
from shardprep.format.manifest import Manifest, load_manifest_file
from shardprep.hub.cache_state import STATE_DIR, fetch_lock, write_atomic

REFS_DIR = "refs"

logger = logging.getLogger("shardprep.hub.cache")


def resolve_commit(
    repo_dir: Path, repo_id: str, revision: str, remote: hub_client.Remote | None
) -> tuple[str, hub_client.Remote | None]:
    """The commit `revision` names, and the remote to use (None: work from the cache only)."""
    if hub_client.is_commit(revision):
        return revision, remote
    if remote is not None:
        try:
            return remote.resolve(revision), remote
        except HubError as exc:
            cached = read_ref(repo_dir, revision)
            if cached is None or not hub_client.is_connection_error(exc.__cause__ or exc):
                raise
            logger.warning("%s; using %s@%s from the cache", exc, repo_id, cached[:12])
            return cached, None
    cached = read_ref(repo_dir, revision)
    if cached is None:
        raise HubError(
            f"HF_HUB_OFFLINE is set and the cache ({repo_dir}) has never fetched {repo_id}@"
            f"{revision}. Fetch it once with network access: `shardprep fetch {repo_id} "
            "--stage P`"
        )
    return cached, None


def ref_path(repo_dir: Path, revision: str) -> Path:
    parts = PurePosixPath(revision).parts
    if not parts or ".." in parts or revision.startswith("/"):
        raise ConfigError(f"revision {revision!r} is not a branch, tag or commit name")
    return repo_dir.joinpath(REFS_DIR, *parts)


def read_ref(repo_dir: Path, revision: str) -> str | None:
    path = ref_path(repo_dir, revision)
    commit = path.read_text().strip() if path.is_file() else ""
    return commit if hub_client.is_commit(commit) else None


def write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    if read_ref(repo_dir, revision) != commit:
        write_atomic(ref_path(repo_dir, revision), commit)


def cached_manifest(
    folder: Path, repo_id: str, commit: str, remote: hub_client.Remote | None
) -> Manifest:
    """The commit's manifest: from the cache, else downloaded once (under a lock) and checked
    against the id the Hub gives the file."""
    path = folder / STATE_DIR / FETCHED_MANIFEST
    where = f"{repo_id}@{commit[:12]}/{MANIFEST_NAME}"
    if not path.is_file():
        if remote is None:
            raise HubError(
                f"HF_HUB_OFFLINE is set and the cache holds nothing of {repo_id}@{commit[:12]} "
                f"({folder}). Fetch it once with network access: `shardprep fetch {repo_id} "
                "--stage P`"
            )
        with fetch_lock(folder, "manifest", f"the manifest of {repo_id}", remote.progress):
            if not path.is_file():
                download_manifest(folder, path, commit, remote)
    return load_manifest_file(path, where)


def download_manifest(folder: Path, path: Path, commit: str, remote: hub_client.Remote) -> None:
    staging = folder / STATE_DIR / "staging" / "manifest"
    file_id = remote.file_id(commit, MANIFEST_NAME)
    for again in (False, True):
        staged = remote.download(commit, MANIFEST_NAME, staging, again=again)
        if hub_client.matches_file_id(staged, file_id):
            os.replace(staged, path)
            shutil.rmtree(staging, ignore_errors=True)
            return
        staged.unlink()
    raise CorruptFileError(
        f"{remote.repo_id}@{commit[:12]}: {MANIFEST_NAME} does not match the {file_id[0]} the "
        f"Hub lists for it ({file_id[1][:12]}...), on two downloads in a row. Nothing was "
        "placed in the cache; try again later, or publish the artifact again",
        path=MANIFEST_NAME,
    )


def recheck_manifest(folder: Path, commit: str, remote: hub_client.Remote) -> None:
    """The cached manifest against the id the Hub gives it; a damaged one is removed (with
    the copy at the folder's root) and downloaded again."""
    path = folder / STATE_DIR / FETCHED_MANIFEST
    if path.is_file() and not hub_client.matches_file_id(
        path, remote.file_id(commit, MANIFEST_NAME)
    ):
        logger.warning("%s in the cache does not match the Hub; downloading it again", path)
        path.unlink()
        (folder / MANIFEST_NAME).unlink(missing_ok=True)


def place_manifest(folder: Path) -> None:
    """`shardprep.json` appears in the folder once a first part of it is complete."""
    final = folder / MANIFEST_NAME
    if not final.is_file():
        write_atomic(final, (folder / STATE_DIR / FETCHED_MANIFEST).read_text())
