"""Publishing an artifact to the Hugging Face Hub, and the small Hub client the cache uses.

`publish` refuses an artifact that fails `verify`, stages what it uploads in
`OUT/.shardprep-publish/` (hard links to the artifact's files, or `<path>.zst` when
compressed, a manifest that records the codec, and a model card), then calls
`HfApi.upload_folder`. The staged folder is removed once the commit exists; a rerun after an
interruption reuses the compressed files whose sha256 still match.

`Remote` is what `shardprep.cache` needs from the Hub: resolve a revision to a commit, the id
the Hub gives a file, and one file downloaded into a folder. Every failure of the client
becomes a `HubError` that says what to do.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import disable_progress_bars, validate_repo_id

from shardprep import __version__
from shardprep import manifest as mf
from shardprep.constants import INCOMPLETE_SUFFIX, MANIFEST_NAME
from shardprep.errors import ConfigError, CorruptFileError, HubError, ManifestError
from shardprep.modelcard import model_card
from shardprep.progress import Progress as tqdm
from shardprep.progress import is_terminal
from shardprep.safetensors_io import sha256_file

PUBLISH_STAGING = ".shardprep-publish"
CARD_NAME = "README.md"
# The stored name of a compressed file is its logical path plus this suffix.
CODEC_SUFFIXES = {"zstd": ".zst"}
# Weight files of an earlier publish that this commit does not carry are deleted with it.
STALE_PATTERNS = ["shards/*", "draft/shards/*"]
_JOURNAL = ".compressed.json"
_COMMIT = re.compile(r"[0-9a-f]{40}")


def publish(
    artifact: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str = "main",
    compress: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    progress: bool = True,
) -> str:
    """Upload a verified artifact (and its model card) to `repo_id`; return the commit id.

    `compress="zstd"` uploads each rank file as `<path>.zst` and records codec, stored size
    and stored sha256 in the uploaded manifest; `shardprep fetch` undoes it into the cache.
    """
    artifact = Path(artifact)
    check_repo_id(repo_id)
    codec = codec_for(compress)
    manifest = _verified_manifest(artifact, progress)
    staging = _staging_folder(artifact)
    files = _stage_rank_files(artifact, staging, manifest, codec, progress)
    for extra in manifest.extra_files:
        _link(artifact / extra.path, staging / extra.path)
    published = dataclasses.replace(manifest, files=files)
    mf.write_manifest(staging, published)
    (staging / CARD_NAME).write_text(model_card(published, repo_id))
    names = [MANIFEST_NAME, CARD_NAME, *(e.path for e in manifest.extra_files)]
    names += [stored_path(f) for f in files]
    api = HfApi(endpoint=endpoint, token=token)
    # huggingface_hub's nested upload bars cannot be made plain: off outside a terminal
    quiet = nullcontext() if progress and is_terminal() else disable_progress_bars()
    with quiet, hub_errors(f"Publishing {artifact} to {repo_id}", repo_id, endpoint, write=True):
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision != constants.DEFAULT_REVISION:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=staging,
            revision=revision,
            allow_patterns=[glob.escape(name) for name in names],
            delete_patterns=STALE_PATTERNS,
            commit_message=_commit_message(published, codec),
        )
    shutil.rmtree(staging, ignore_errors=True)
    return info.oid


def codec_for(compress: str | None) -> str:
    """The codec name for `--compress`: "none" when absent; a miss lists the choices."""
    name = compress or "none"
    if name != "none" and name not in CODEC_SUFFIXES:
        choices = ", ".join(sorted(CODEC_SUFFIXES))
        raise ConfigError(f"--compress {compress!r} is not a transport codec; choose {choices}")
    return name


def stored_path(entry: mf.FileEntry) -> str:
    """The name of a rank file in the repo: its path, plus `.zst` when compressed."""
    if entry.codec == "none":
        return entry.path
    suffix = CODEC_SUFFIXES.get(entry.codec)
    if suffix is None or entry.stored_bytes is None or entry.stored_sha256 is None:
        raise ManifestError(
            f"{MANIFEST_NAME} stores {entry.path} with codec {entry.codec!r} "
            f"(stored size {entry.stored_bytes}, sha256 {entry.stored_sha256}), which this "
            f"shardprep {__version__} cannot undo; upgrade shardprep"
        )
    return entry.path + suffix


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(
            f"{repo_id!r} is not a Hub repo id like org/Model-TP8-PP2 ({exc})"
        ) from None


def _verified_manifest(artifact: Path, progress: bool) -> mf.Manifest:
    from shardprep.verify import verify  # imports torch: only publishing needs it

    manifest = mf.read_manifest(artifact)
    result = verify(artifact, progress=progress)
    if result.ok and not result.complete:
        raise ConfigError(
            f"Refusing to publish {artifact}: it is a fetched folder that holds "
            f"{result.scope()}. Publish the folder `shardprep convert` wrote"
        )
    if not result.ok:
        shown = "; ".join(result.problems[:3])
        more = f"; and {len(result.problems) - 3} more" if len(result.problems) > 3 else ""
        raise CorruptFileError(
            f"Refusing to publish {artifact}: it fails verification ({shown}{more}). "
            f"Re-run `shardprep convert` into it to repair it (a rerun resumes), check it with "
            f"`shardprep verify {artifact}`, then publish again",
            path=str(artifact),
        )
    return manifest


def _staging_folder(artifact: Path) -> Path:
    staging = artifact / PUBLISH_STAGING
    try:
        staging.mkdir(exist_ok=True)
    except OSError as exc:
        raise HubError(
            f"Cannot create {staging} ({exc.strerror}): publishing stages the upload inside the "
            "artifact. Make the folder writable, or copy the artifact somewhere writable"
        ) from exc
    return staging


def _stage_rank_files(
    artifact: Path, staging: Path, manifest: mf.Manifest, codec: str, progress: bool
) -> tuple[mf.FileEntry, ...]:
    """Link or compress every rank file into `staging`; return the entries to publish."""
    journal = _read_journal(staging)
    staged = []
    for entry in tqdm(manifest.files, desc=f"stage ({codec})", unit="file", disable=not progress):
        plain = dataclasses.replace(entry, codec="none", stored_bytes=None, stored_sha256=None)
        if codec == "none":
            _link(artifact / entry.path, staging / entry.path)
            staged.append(plain)
            continue
        stored = _compressed(artifact, staging, plain, codec, journal)
        staged.append(stored)
        journal[entry.path] = {
            "sha256": entry.sha256,
            "stored_bytes": stored.stored_bytes,
            "stored_sha256": stored.stored_sha256,
        }
        _write_journal(staging, journal)
    return tuple(staged)


def _compressed(
    artifact: Path, staging: Path, entry: mf.FileEntry, codec: str, journal: dict[str, dict]
) -> mf.FileEntry:
    """Compress one rank file, or reuse the one an interrupted publish left if it still hashes
    to what the journal recorded for these very raw bytes."""
    from shardprep.codec import compress_file

    target = staging / (entry.path + CODEC_SUFFIXES[codec])
    known = journal.get(entry.path)
    if (
        known is not None
        and known["sha256"] == entry.sha256
        and target.is_file()
        and target.stat().st_size == known["stored_bytes"]
        and sha256_file(target) == known["stored_sha256"]
    ):
        return dataclasses.replace(
            entry,
            codec=codec,
            stored_bytes=known["stored_bytes"],
            stored_sha256=known["stored_sha256"],
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    result = compress_file(artifact / entry.path, target, codec)
    if (result.raw_bytes, result.raw_sha256) != (entry.bytes, entry.sha256):
        raise CorruptFileError(
            f"{artifact / entry.path} changed while it was being published; run "
            f"`shardprep verify {artifact}` and publish again",
            path=str(artifact / entry.path),
        )
    return dataclasses.replace(
        entry, codec=codec, stored_bytes=result.stored_bytes, stored_sha256=result.stored_sha256
    )


def _read_journal(staging: Path) -> dict[str, dict]:
    try:
        data = json.loads((staging / _JOURNAL).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_journal(staging: Path, journal: dict[str, dict]) -> None:
    tmp = staging / (_JOURNAL + INCOMPLETE_SUFFIX)
    tmp.write_text(json.dumps(journal, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, staging / _JOURNAL)


def _link(src: Path, dst: Path) -> None:
    """Put `src` at `dst` without copying its bytes: a hard link, else a symbolic link."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(src.resolve(), dst)


def _commit_message(manifest: mf.Manifest, codec: str) -> str:
    topo = manifest.topology
    packed = "" if codec == "none" else f", {codec}"
    return f"shardprep {__version__}: tp{topo.tp} pp{topo.pp} artifact{packed}"


# ---------------------------------------------------------------------------- the client


def is_offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub read it at import."""
    return bool(constants.HF_HUB_OFFLINE)


def is_commit(revision: str | None) -> bool:
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def is_connection_error(exc: BaseException) -> bool:
    # Matched by name: huggingface_hub's HTTP client (httpx, httpx2) differs by version.
    transport = any(cls.__name__ == "TransportError" for cls in type(exc).__mro__)
    return transport or isinstance(exc, (OfflineModeIsEnabled, ConnectionError))


@dataclasses.dataclass(frozen=True)
class Remote:
    """One repo on one Hub endpoint, as the cache talks to it."""

    repo_id: str
    endpoint: str | None = None
    token: str | None = None
    progress: bool = True

    @property
    def where(self) -> str:
        return self.endpoint or constants.ENDPOINT

    def resolve(self, revision: str) -> str:
        """The commit id a branch, tag or commit names now."""
        if is_commit(revision):
            return revision
        with hub_errors(f"Resolving {self.repo_id}@{revision}", self.repo_id, self.endpoint):
            info = HfApi(endpoint=self.endpoint, token=self.token).repo_info(
                self.repo_id, revision=revision
            )
        if not is_commit(info.sha):
            raise HubError(f"{self.where} gave no commit id for {self.repo_id}@{revision}")
        return info.sha

    def file_id(self, commit: str, path: str) -> tuple[str, str]:
        """("sha256", hex) for a file in LFS, ("git-sha1", hex) for one stored in git."""
        with hub_errors(f"Looking up {path} in {self.repo_id}", self.repo_id, self.endpoint):
            infos = HfApi(endpoint=self.endpoint, token=self.token).get_paths_info(
                self.repo_id, [path], revision=commit
            )
        for info in infos:
            if isinstance(info, RepoFile) and info.path == path:
                return ("sha256", info.lfs.sha256) if info.lfs else ("git-sha1", info.blob_id)
        raise HubError(
            f"{self.repo_id}@{commit[:12]} has no {path}: it is not a shardprep artifact, or its "
            f"upload is incomplete. Publish it with `shardprep publish OUT {self.repo_id}`"
        )

    def download(self, commit: str, path: str, folder: Path, *, again: bool = False) -> Path:
        """`path` of `commit` into `folder` (huggingface_hub resumes a cut transfer there).
        `again` skips any copy the Hugging Face cache or `folder` already holds."""
        with hub_errors(f"Downloading {path} of {self.repo_id}", self.repo_id, self.endpoint):
            local = hf_hub_download(
                self.repo_id,
                path,
                revision=commit,
                local_dir=folder,
                endpoint=self.endpoint,
                token=self.token,
                force_download=again,
                tqdm_class=tqdm if self.progress else _Silent,
            )
        return Path(local)


def matches_file_id(path: Path, file_id: tuple[str, str]) -> bool:
    kind, expected = file_id
    if kind == "sha256":
        return sha256_file(path) == expected
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest() == expected


class _Silent(tqdm):
    """A progress bar that never shows (huggingface_hub passes vanilla tqdm its kwargs)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


@contextmanager
def hub_errors(
    action: str, repo_id: str, endpoint: str | None, *, write: bool = False
) -> Iterator[None]:
    """Turn the client's exceptions into one HubError that says what to do."""
    where = endpoint or constants.ENDPOINT
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        yield
    except RepositoryNotFoundError as exc:
        raise HubError(
            f"{action} failed: {repo_id} is not on {where}, or it is private or gated and no "
            f"token with access was given. Check the name, or {login}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise HubError(
            f"{action} failed: {repo_id} has no such revision on {where}. "
            "Pass a branch, tag or commit id that exists (--revision)"
        ) from exc
    except RemoteEntryNotFoundError as exc:
        raise HubError(
            f"{action} failed: the file is missing from {repo_id} on {where} although its "
            f"{MANIFEST_NAME} lists it; the upload is incomplete. Publish it again with "
            f"`shardprep publish OUT {repo_id}`"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            need = "write access" if write else "read access"
            raise HubError(
                f"{action} failed: {where} refused the request ({status}); {login} with a "
                f"token that has {need} to {repo_id}"
            ) from exc
        raise HubError(f"{action} failed: {where} answered {status}: {exc}") from exc
    except Exception as exc:
        if not is_connection_error(exc):
            raise
        raise HubError(
            f"{action} failed: cannot reach {where} ({type(exc).__name__}: {exc}). Check the "
            "network, HF_ENDPOINT or --endpoint; a stage fetched before works offline with "
            "HF_HUB_OFFLINE=1"
        ) from exc
