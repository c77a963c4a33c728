"""The stage-sharded cache: a node holds only the stages it serves, verified, plain.

    $SHARDPREP_CACHE/models--{org}--{name}/        (default: $HF_HOME/shardprep/...)
      refs/{revision}                              the commit a branch or tag named when fetched
      {commit}/                                    the folder vLLM is pointed at
        shardprep.json                             the published manifest (codec info included),
                                                   written once a first stage is complete
        config.json, tokenizer*, ...               every extra file of the manifest
        shards/..., draft/...                      plain safetensors of the fetched stages only
        .shardprep/manifest.json                   the manifest as fetched, before any stage
        .shardprep/done/stage-{P}[-rank-{R}].json  completion markers: files and sizes
        .shardprep/locks/                          one file lock per stage, one for the manifest
        .shardprep/staging/                        downloads in progress (huggingface_hub's
                                                   local_dir), never read by anyone else

A stage is fetched under its lock: the first process downloads it, the others wait and then
find its marker. Each file is downloaded into staging, its size and sha256 checked against
the manifest (the stored form for a compressed file, then the raw form after decompressing),
and only then renamed to its final path; a file that fails is downloaded once more, then the
fetch fails naming it. Files already at their final path were verified before they got there,
so a rerun after an interruption downloads only what is missing. With HF_HUB_OFFLINE=1, or
when the Hub cannot be reached, a revision resolves through `refs/` and a stage whose marker
exists is served without any request.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from huggingface_hub import constants as hf_constants

from shardprep import hub_client
from shardprep.constants import (
    ENV_CACHE,
    FETCHED_MANIFEST,
    MANIFEST_NAME,
    cache_root,
)
from shardprep.errors import ConfigError, CorruptFileError, HubError, summarize
from shardprep.format.manifest import Manifest
from shardprep.format.request import check_revision
from shardprep.hashing import sha256_file
from shardprep.hub.cache_manifest import (
    cached_manifest,
    place_manifest,
    recheck_manifest,
    resolve_commit,
    write_ref,
)
from shardprep.hub.cache_parts import (
    RunningSplit,
    check_request,
    requested_parts,
    split_parts,
    wanted_files,
    worker_parts,
)
from shardprep.hub.cache_state import (
    STATE_DIR,
    Part,
    Wanted,
    fetch_lock,
    is_complete,
    write_marker,
)

DOWNLOAD_WORKERS = 8

logger = logging.getLogger("shardprep.hub.cache")


def repo_folder(repo_id: str, cache_dir: Path | str | None = None) -> Path:
    """`models--{org}--{name}` under the cache root (SHARDPREP_CACHE or the HF home)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    if root.exists() and not root.is_dir():
        given = "--cache-dir" if cache_dir is not None else f"{ENV_CACHE} (or HF_HOME)"
        raise ConfigError(
            f"the cache folder {root} is a file, not a folder; point {given} at a folder"
        )
    return root / ("models--" + repo_id.replace("/", "--"))


def fetch(
    repo_id: str,
    *,
    stage: int | None = None,
    rank: int | None = None,
    all_stages: bool = False,
    pp: int | None = None,
    tp: int | None = None,
    revision: str | None = None,
    cache_dir: Path | str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    progress: bool = True,
    verify: bool = False,
) -> Path:
    """Make the cache hold `stage` of `repo_id` (or its `rank` only, or `all_stages`) and
    return the folder to point vLLM at. Only the manifest, the extra files and that part's
    rank files are downloaded; a part fetched before needs no network. `verify` re-hashes
    what the cache already holds of the part and downloads again any file that fails.
    `pp`: `stage` is a stage of that pipeline split (VLLM_PP_LAYER_PARTITION, else vLLM's
    default), and the artifact's stages that hold its layers are fetched. `tp`: `rank` is
    a rank of that tp (dividing the artifact's), and the artifact's ranks it is made of
    are fetched."""
    hub_client.check_repo_id(repo_id)
    check_request(stage, rank, all_stages, pp, tp)

    def parts(manifest: Manifest) -> list[Part]:
        if stage is None or (pp is None and tp is None):
            return requested_parts(manifest, repo_id, stage, rank, all_stages)
        return split_parts(manifest, repo_id, stage, rank, pp=pp, tp=tp)

    return _fetch(repo_id, parts, revision, cache_dir, endpoint, token, progress, verify)


def ensure_stage(
    repo_id_or_path: str, stage: int, *, revision: str | None = None, progress: bool = False
) -> Path:
    """A local artifact folder that holds `stage`. A folder is returned as it is; a Hub
    repo id is fetched into the cache (only that stage), or found there."""
    local = _local(repo_id_or_path)
    if local is not None:
        return local
    return fetch(str(repo_id_or_path), stage=stage, revision=revision, progress=progress)


def ensure_rank(
    repo_id_or_path: str,
    role: str,
    *,
    stage: int,
    tp: int,
    tp_rank: int,
    partition: Sequence[int] | None,
    experts: RunningSplit | None = None,
    revision: str | None = None,
    progress: bool = False,
) -> Path:
    """For the loader: a local artifact folder that holds what the vLLM worker at `stage`
    of the pipeline split `partition` (None for a draft), tp rank `tp_rank` of `tp`, reads
    to load `role` (`worker_parts`; `experts`: how vLLM spreads a model's experts on this
    worker). A folder is returned as it is; for a Hub repo id only those parts are fetched
    into the cache (once per node, under a lock), or found there."""
    local = _local(repo_id_or_path)
    if local is not None:
        return local
    repo_id = str(repo_id_or_path)

    def parts(manifest: Manifest) -> list[Part]:
        return worker_parts(manifest, repo_id, role, stage, tp, tp_rank, partition, experts)

    return _fetch(repo_id, parts, revision, None, None, None, progress, False)


def _local(repo_id_or_path: str) -> Path | None:
    local = Path(repo_id_or_path).expanduser()
    if local.is_dir():
        return local
    text = str(repo_id_or_path)
    if text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ConfigError(
            f"{text} is neither a folder nor a Hub repo id: convert a model into it "
            "(`shardprep convert`) or name a repo like org/Model-TP8-PP2"
        )
    return None


def _fetch(
    repo_id: str,
    parts: Callable[[Manifest], list[Part]],
    revision: str | None,
    cache_dir: Path | str | None,
    endpoint: str | None,
    token: str | None,
    progress: bool,
    verify: bool,
) -> Path:
    hub_client.check_repo_id(repo_id)
    repo_dir = repo_folder(repo_id, cache_dir)
    revision = revision or hf_constants.DEFAULT_REVISION
    check_revision(revision)
    remote = (
        None if hub_client.is_offline() else hub_client.Remote(repo_id, endpoint, token, progress)
    )
    commit, remote = resolve_commit(repo_dir, repo_id, revision, remote)
    folder = repo_dir / commit
    if verify and remote is not None:
        recheck_manifest(folder, commit, remote)
    manifest = cached_manifest(folder, repo_id, commit, remote)
    for part in parts(manifest):
        if verify:
            _recheck(folder, repo_id, manifest, part, remote, progress)
        _fetch_part(folder, repo_id, manifest, part, remote, progress)
    if not hub_client.is_commit(revision):
        write_ref(repo_dir, revision, commit)
    return folder


# ---------------------------------------------------------------------------- re-verifying


def _recheck(
    folder: Path,
    repo_id: str,
    manifest: Manifest,
    part: Part,
    remote: hub_client.Remote | None,
    progress: bool,
) -> None:
    """Re-hash the part's files in the cache; remove any that fail (and a root manifest
    that differs from the fetched one), so that the fetch downloads them again."""
    damaged = []
    with fetch_lock(folder, f"stage-{part.stage}", f"stage {part.stage}", progress):
        for item in wanted_files(manifest, part):
            final = folder / item.path
            if final.is_file() and _check(final, item.bytes, item.sha256) is not None:
                final.unlink()
                damaged.append(item.path)
        placed, fetched = folder / MANIFEST_NAME, folder / STATE_DIR / FETCHED_MANIFEST
        if placed.is_file() and placed.read_bytes() != fetched.read_bytes():
            placed.unlink()
            damaged.append(MANIFEST_NAME)
    for path in damaged:
        logger.warning("%s in the cache does not match its sha256; it was removed", path)
    if damaged and remote is None:
        raise CorruptFileError(
            f"{summarize(damaged)} of {repo_id} in the cache ({folder}) did not match "
            f"{MANIFEST_NAME} and {'were' if len(damaged) > 1 else 'was'} removed; the Hub is "
            f"not used (HF_HUB_OFFLINE is set, or it could not be reached): run `shardprep "
            f"fetch {repo_id} --stage {part.stage}` again with network access",
            path=str(folder / damaged[0]),
        )


# ---------------------------------------------------------------------------- one part


def _fetch_part(
    folder: Path,
    repo_id: str,
    manifest: Manifest,
    part: Part,
    remote: hub_client.Remote | None,
    progress: bool,
) -> None:
    if is_complete(folder, part):
        return
    if remote is None:
        raise HubError(
            f"{part} of {repo_id}@{folder.name[:12]} is not in the cache ({folder}) and the "
            "Hub is not used (HF_HUB_OFFLINE is set, or it could not be reached). Fetch it "
            f"once with network access: `shardprep fetch {repo_id} --stage {part.stage}`"
        )
    with fetch_lock(folder, f"stage-{part.stage}", f"stage {part.stage}", progress):
        if is_complete(folder, part):
            return
        wanted = wanted_files(manifest, part)
        staging = folder / STATE_DIR / "staging" / f"stage-{part.stage}"
        _download_and_place(folder, staging, wanted, remote)
        place_manifest(folder)
        write_marker(folder, part, wanted)
        shutil.rmtree(staging, ignore_errors=True)


def _download_and_place(
    folder: Path, staging: Path, wanted: list[Wanted], remote: hub_client.Remote
) -> None:
    """Download what is not in place yet, verify each file as it arrives, rename it into
    place; one more download for a file that fails, then a CorruptFileError naming it."""
    commit = folder.name
    todo = [w for w in wanted if not _in_place(folder, w)]
    if not todo:
        return
    with ThreadPoolExecutor(max_workers=DOWNLOAD_WORKERS, thread_name_prefix="fetch") as pool:
        pending: dict[Future[Path], tuple[Wanted, bool]] = {
            pool.submit(remote.download, commit, w.stored, staging): (w, False) for w in todo
        }
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    item, again = pending.pop(future)
                    problem = _place(folder, staging, item, future.result())
                    if problem is None:
                        continue
                    if isinstance(problem, _Undecodable):
                        raise _undecodable(remote.repo_id, folder, item, problem)
                    if again:
                        raise _corrupt(remote.repo_id, folder, item, problem)
                    logger.warning("%s %s; downloading it again", item.stored, problem)
                    retry = pool.submit(remote.download, commit, item.stored, staging, again=True)
                    pending[retry] = (item, True)
        finally:
            for future in pending:
                future.cancel()


def _in_place(folder: Path, item: Wanted) -> bool:
    """Only verified files are ever renamed to a final path: there, the size suffices."""
    final = folder / item.path
    return final.is_file() and final.stat().st_size == item.bytes


class _Undecodable(str):
    """A problem with a stored file whose bytes are the ones the manifest names: fetching
    them again cannot help."""


def _place(folder: Path, staging: Path, item: Wanted, staged: Path) -> str | None:
    """Check the staged file and rename its plain form into place; else say what is wrong
    (the staged file is then deleted, so a download starts from scratch)."""
    problem: str | None = _check(staged, item.stored_bytes, item.stored_sha256)
    if problem is None and item.codec != "none":
        problem = _decompress(staged, staging / item.path, item)
        staged.unlink(missing_ok=True)
        staged = staging / item.path
    if problem is not None:
        staged.unlink(missing_ok=True)
        return problem
    final = folder / item.path
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, final)
    return None


def _check(path: Path, size: int, sha256: str) -> str | None:
    found = path.stat().st_size
    if found != size:
        return f"has {found:,} bytes where {MANIFEST_NAME} says {size:,}"
    digest = sha256_file(path)
    if digest != sha256:
        return f"has sha256 {digest[:12]}... where {MANIFEST_NAME} says {sha256[:12]}..."
    return None


def _decompress(stored: Path, plain: Path, item: Wanted) -> str | None:
    from shardprep.codec import decompress_file

    try:
        result = decompress_file(stored, plain, expected_bytes=item.bytes)
    except CorruptFileError as exc:
        return _Undecodable(f"does not decompress ({exc})")
    if (result.raw_bytes, result.raw_sha256) != (item.bytes, item.sha256):
        plain.unlink(missing_ok=True)
        return _Undecodable(
            f"decompresses to {result.raw_bytes:,} bytes of sha256 {result.raw_sha256[:12]}... "
            f"where {MANIFEST_NAME} says {item.bytes:,} and {item.sha256[:12]}..."
        )
    return None


def _undecodable(repo_id: str, folder: Path, item: Wanted, problem: str) -> CorruptFileError:
    return CorruptFileError(
        f"{repo_id}@{folder.name[:12]}: {item.stored} matches the sha256 in {MANIFEST_NAME} "
        f"but {problem}. The copy on the Hub is damaged or hostile: nothing of it was placed "
        f"in {folder}. Publish the artifact again (`shardprep publish OUT {repo_id}`) or tell "
        "the repo's owner",
        path=item.stored,
    )


def _corrupt(repo_id: str, folder: Path, item: Wanted, problem: str) -> CorruptFileError:
    return CorruptFileError(
        f"{repo_id}@{folder.name[:12]}: {item.stored} {problem}, on two downloads in a row. "
        f"The copy on the Hub is damaged: nothing of it was placed in {folder}. Publish the "
        f"artifact again (`shardprep publish OUT {repo_id}`) or tell the repo's owner",
        path=item.stored,
    )
