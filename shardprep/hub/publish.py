"""Publishing an artifact to the Hugging Face Hub.

`publish` refuses an artifact that fails `verify`, stages what it uploads in
`OUT/.shardprep-publish/` (hard links to the artifact's files, or `<path>.zst` when
compressed, a manifest that records the codec, and a model card), then calls
`HfApi.upload_folder`. The staged folder is removed once the commit exists; a rerun after an
interruption reuses the compressed files whose sha256 still match.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.utils import disable_progress_bars

from shardprep import __version__, safefs
from shardprep.constants import MANIFEST_NAME
from shardprep.errors import ConfigError, CorruptFileError, HubError
from shardprep.format import manifest as mf
from shardprep.hashing import sha256_file
from shardprep.hub.modelcard import model_card
from shardprep.hub_client import CODEC_SUFFIXES, check_repo_id, hub_errors, stored_path
from shardprep.progress import Progress as tqdm
from shardprep.progress import is_terminal

PUBLISH_STAGING = ".shardprep-publish"
CARD_NAME = "README.md"
# Weight files of an earlier publish that this commit does not carry are deleted with it.
STALE_PATTERNS = ["shards/*", "draft/shards/*"]
_JOURNAL = ".compressed.json"


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
    for extra in manifest.side_files:
        _link(artifact / extra.path, staging / extra.path)
    published = dataclasses.replace(manifest, files=files)
    mf.write_manifest(staging, published)
    safefs.write_atomic(staging / CARD_NAME, model_card(published, repo_id))
    names = [MANIFEST_NAME, CARD_NAME, *(e.path for e in manifest.side_files)]
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


def _verified_manifest(artifact: Path, progress: bool) -> mf.Manifest:
    from shardprep.convert.verify import verify  # imports torch: only publishing needs it

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
    """`OUT/.shardprep-publish/`, a real folder: a link there would put the staged files
    outside the artifact, so it is refused; links inside it (to files or folders) are
    removed, never followed (`_link` makes its own anew)."""
    staging = artifact / PUBLISH_STAGING
    if staging.is_symlink():
        raise ConfigError(
            f"Refusing to publish {artifact}: {staging} is a symbolic link, and publishing "
            "stages the upload inside the artifact only. Remove the link and publish again"
        )
    try:
        staging.mkdir(exist_ok=True)
    except OSError as exc:
        raise HubError(
            f"Cannot create {staging} ({exc.strerror}): publishing stages the upload inside the "
            "artifact. Make the folder writable, or copy the artifact somewhere writable"
        ) from exc
    for folder, dirs, files in os.walk(staging):
        for name in [*dirs, *files]:
            if os.path.islink(os.path.join(folder, name)):
                os.unlink(os.path.join(folder, name))
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
    safefs.write_atomic(staging / _JOURNAL, json.dumps(journal, indent=1, sort_keys=True) + "\n")


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
