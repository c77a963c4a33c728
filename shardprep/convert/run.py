"""Execute a plan: read every source byte once, write every output byte once.

The bytes move in `scatter.py` (rank files written under a temporary name, hashed as
they are written, then renamed); the extra files are copied and the manifest
(`record.py`) is written last. A journal lets a rerun skip files already complete and verified.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from shardprep import safefs
from shardprep.constants import (
    CHUNK_BYTES,
    COPIED_FILE_PATTERNS,
    ENV_PP_PARTITION,
    INCOMPLETE_SUFFIX,
    SOURCE_DOWNLOAD_DIR,
    pp_partition_from_env,
)
from shardprep.convert import outdir
from shardprep.convert.checkpoint import (
    Checkpoint,
    SourceTensor,
    load_side_file,
    require_recordable,
)
from shardprep.convert.dequantize import with_dequantized
from shardprep.convert.hub_budget import (
    BudgetedArrivals,
    begin_fetch,
    prune_private,
    remove_private,
)
from shardprep.convert.hub_source import Arrivals, copied_files, fetch, open_source
from shardprep.convert.journal import Journal, fingerprint
from shardprep.convert.record import manifest_of
from shardprep.convert.scatter import write_rank_files
from shardprep.errors import ShardprepError
from shardprep.format import manifest as mf
from shardprep.format.dtypes import safetensors_name
from shardprep.format.headers import TensorInfo
from shardprep.format.request import ConversionRequest
from shardprep.hashing import sha256_file
from shardprep.plan import archs
from shardprep.plan.checks import counts_fit
from shardprep.plan.make import make_plan
from shardprep.plan.many import no_cycle_collection
from shardprep.plan.records import Plan, SourceModel


@dataclass(frozen=True)
class Options(ConversionRequest):
    """A conversion request, and how to execute it."""

    rehash_source: bool = False  # hash Hugging Face cache blobs instead of trusting their names
    endpoint: str | None = None  # the Hub a repo id is read from (default: HF_ENDPOINT)
    # Most bytes of a Hub source's weight files on disk at once, in a private folder of
    # the output (each deleted once converted) instead of the Hugging Face cache.
    source_budget: int | None = None
    draft_revision: str | None = None  # a Hub draft's revision (verify --full: the recorded one)

    def request(self, plan: Plan, draft_source: str | None) -> ConversionRequest:
        """What the manifest records: the options that shaped `plan`, the partition
        resolved (the environment's included) and the draft as a path from anywhere."""
        asked = {f.name: getattr(self, f.name) for f in dataclasses.fields(ConversionRequest)}
        return ConversionRequest(
            **{
                **asked,
                "draft": draft_source if self.draft else None,
                "partition": ",".join(map(str, plan.topology.partition)),
            }
        )


def source_model(checkpoint: Checkpoint) -> SourceModel:
    tensors = {n: (t.info.dtype, t.info.shape) for n, t in checkpoint.tensors.items()}
    return SourceModel(checkpoint.config, tensors)


def read_source(checkpoint: Checkpoint) -> SourceModel:
    """The checkpoint's headers, with config.json as vLLM reads it."""
    source = source_model(checkpoint)
    return SourceModel(archs.read_config(source.config), source.tensors)


T = TypeVar("T")


def load_and_plan(model: str, options: Options) -> tuple[Plan, dict[str, Checkpoint]]:
    """Open the checkpoints (headers only: a Hub repo's by range request) and plan;
    nothing is written."""
    with no_cycle_collection():
        return _load_and_plan(model, options)


def _load_and_plan(model: str, options: Options) -> tuple[Plan, dict[str, Checkpoint]]:
    target = open_source(model, options.revision, endpoint=options.endpoint)
    target = with_dequantized(target)
    checkpoints = {"target": target}
    method = options.draft_method
    notes: list[str] = []
    if options.draft:
        draft = open_source(options.draft, options.draft_revision, endpoint=options.endpoint)
        target_family = archs.target_family(target.config)[1].name
        method = method or archs.detect_draft_method(
            draft.config, sorted(draft.tensors), target_family
        )
        checkpoints["draft"] = with_side_tensors(draft, archs.draft_family(method, target_family))
    elif options.mtp_draft and (internal := archs.internal_draft_method(target.config)):
        # The draft's tensors are in the target checkpoint, which is read once for both.
        family = archs.draft_family(internal, archs.target_family(target.config)[1].name)
        # Counts beyond the headers are not enumerated here: planning the draft names them.
        if not counts_fit(family, read_source(target)) or family.carried_by(
            target.config, target.tensors
        ):
            checkpoints["draft"], method = target, internal
        else:  # e.g. a DeepSeek-V3 re-saved by transformers, which drops the MTP layers
            notes.append(
                f"config.json promises a {internal} draft inside the checkpoint, which holds "
                f"none of its tensors: the target is converted without a {internal} draft"
            )
    for checkpoint in checkpoints.values():  # a local folder's were checked as it was opened
        for name in copied_files(checkpoint):
            require_recordable(name, checkpoint.repo_id or checkpoint.root)
    partition = options.partition or pp_partition_from_env()
    plan = make_plan(
        source_model(target),
        dataclasses.replace(options, draft_method=method, partition=partition),
        source_model(checkpoints["draft"]) if "draft" in checkpoints else None,
        partition_origin="" if options.partition else f"the environment ({ENV_PP_PARTITION})",
        distinct_copies=in_background(lambda: distinct_copies(checkpoints, method)),
    )
    plan = dataclasses.replace(plan, notes=tuple(notes))
    return plan, checkpoints


def in_background(work: Callable[[], T]) -> Callable[[], T]:
    """`work` started on a thread of its own (reads, which leave the interpreter free);
    the call returned waits for its result, or raises what it raised. A thread nobody
    waits for does not keep the process from ending."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as exc:  # handed to the one who waits
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="shardprep-compare", daemon=True)
    thread.start()

    def result() -> T:
        thread.join()
        finished, value = outcome[0]
        if not finished:
            raise value
        return cast(T, value)

    return result


def distinct_copies(checkpoints: dict[str, Checkpoint], method: str | None) -> frozenset[str]:
    """The draft's copies of target tensors whose bytes differ from the target's: those
    the draft must hold itself (the others vLLM serves with the target's)."""
    target, draft = checkpoints["target"], checkpoints.get("draft")
    if draft is None or method is None:
        return frozenset()
    family = archs.draft_family(method, archs.target_family(target.config)[1].name)
    if not counts_fit(family, read_source(draft)):
        return frozenset()  # planning refuses the draft's counts
    pairs = [
        (copy, original)
        for copy, original in family.shared_copies(draft.config).items()
        if copy in draft.tensors and original in target.tensors
    ]
    if not pairs:
        return frozenset()
    with ThreadPoolExecutor(min(len(pairs), 4), thread_name_prefix="shardprep-compare") as pool:
        same = pool.map(lambda pair: same_bytes(draft, pair[0], target, pair[1]), pairs)
        return frozenset(copy for (copy, _), alike in zip(pairs, same, strict=True) if not alike)


def same_bytes(a: Checkpoint, a_name: str, b: Checkpoint, b_name: str) -> bool:
    """Whether two source tensors hold the same dtype, shape and bytes (read in chunks;
    by range request for a Hub source's file not downloaded yet)."""
    first, second = a.tensors[a_name], b.tensors[b_name]
    if (first.info.dtype, first.info.shape) != (second.info.dtype, second.info.shape):
        return False
    done, total = 0, first.info.nbytes
    buffers = bytearray(min(total, CHUNK_BYTES)), bytearray(min(total, CHUNK_BYTES))
    while done < total:
        step = min(total - done, CHUNK_BYTES)
        left = a.read(first.file, first.info.offset + done, step, into=buffers[0])
        if left != b.read(second.file, second.info.offset + done, step, into=buffers[1]):
            return False
        done += step
    return True


def with_side_tensors(checkpoint: Checkpoint, family: archs.DraftFamily) -> Checkpoint:
    """The checkpoint plus the tensors its family reads from side files (held in memory:
    they are small, and safetensors is the only format shardprep reads by offset)."""
    fetch(
        checkpoint,
        [
            f
            for f in family.side_tensor_files(checkpoint.config).values()
            if f in (checkpoint.sizes or {})
        ],
    )
    found = {
        name: (file, family.side_tensor(name, load_side_file(path), checkpoint.config, str(path)))
        for name, file in family.side_tensor_files(checkpoint.config).items()
        if (path := checkpoint.root / file).is_file()
    }
    if not found:
        return checkpoint
    import torch

    tensors, side = dict(checkpoint.tensors), {}
    for name, (file, tensor) in sorted(found.items()):
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        dtype = safetensors_name(tensor.dtype)
        tensors[name] = SourceTensor(
            name, file, TensorInfo(dtype, tuple(tensor.shape), 0, len(data))
        )
        side[name] = data
    return dataclasses.replace(checkpoint, tensors=tensors, side_tensors=side)


def convert(
    model: str,
    out: Path,
    options: Options,
    *,
    progress: bool = True,
    source_watch: Callable[[], None] | None = None,
) -> mf.Manifest:
    return convert_folder(
        model, out, options, progress=progress, source_watch=source_watch
    ).manifest


@dataclass(frozen=True)
class Converted:
    manifest: mf.Manifest
    kept: int  # rank files found complete and verified, left as they were
    written: int  # rank files written by this run
    notes: tuple[str, ...] = ()  # the plan's notes


def convert_folder(
    model: str,
    out: Path,
    options: Options,
    *,
    progress: bool = True,
    source_watch: Callable[[], None] | None = None,
) -> Converted:
    """Plan, then execute while holding the output folder's lock. Any failure leaves no
    temporary file behind and is one ShardprepError; a rerun resumes. `source_watch` is
    called whenever the private source folder of a budgeted convert may peak."""
    plan, checkpoints = load_and_plan(model, options)
    given = {"target": model, "draft": options.draft or model}
    sources = {role: _source_name(given[role], cp) for role, cp in checkpoints.items()}
    out = Path(out)
    outdir.prepare(out)
    try:
        with outdir.locked(out):
            safefs.refuse_linked_folders(out, outdir.WRITTEN_FOLDERS)
            outdir.refuse_foreign(out)  # before a download starts or anything is removed
            before = {f.path: outdir.file_id(out / f.path) for f in plan.files}
            private = out / SOURCE_DOWNLOAD_DIR
            arrivals, checkpoints = begin_fetch(
                plan, checkpoints, private, options.source_budget, source_watch, progress=progress
            )
            try:
                manifest = execute(
                    plan,
                    checkpoints,
                    sources,
                    out,
                    progress=progress,
                    rehash_source=options.rehash_source,
                    request=options.request(plan, sources.get("draft")),
                    arrivals=arrivals,
                )
            except BaseException:
                arrivals.close(wait=False)  # a transfer already running still ends
                outdir.remove_incomplete(out)
                raise
            finally:
                if isinstance(arrivals, BudgetedArrivals):
                    arrivals.close()
                    prune_private(private)  # the partial downloads, for a rerun
            arrivals.close()
            remove_private(private)
    except ShardprepError:
        raise
    except OSError as exc:
        raise outdir.write_error(out, exc) from exc
    kept = sum(1 for path, id_ in before.items() if id_ and id_ == outdir.file_id(out / path))
    return Converted(manifest, kept, len(plan.files) - kept, plan.notes)


def _source_name(given: str, checkpoint: Checkpoint) -> str:
    """A Hub id as given; a folder as an absolute path, so that `verify --full` run from
    another folder finds it (a relative path there would read as a Hub id)."""
    return given if checkpoint.repo_id else str(checkpoint.root.resolve())


def execute(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    sources: dict[str, str],
    out: Path,
    *,
    progress: bool = True,
    rehash_source: bool = False,
    request: ConversionRequest | None = None,
    arrivals: Arrivals | None = None,
) -> mf.Manifest:
    """`arrivals`: the Hub source files still downloading; each is waited for just
    before it is read."""
    out = Path(out)
    journal = Journal.open(out, fingerprint(plan, checkpoints), plan, checkpoints)
    # The folder is shardprep's now: what an interrupted run of this or another plan left
    # (temporary files, rank files this plan does not name) goes before anything is written.
    outdir.remove_incomplete(out)
    outdir.remove_unplanned(out, {f.path for f in plan.files})
    done = journal.verified_files(out)
    todo = [f for f in plan.files if f.path not in done]
    source_hashes = write_rank_files(
        plan,
        checkpoints,
        out,
        todo,
        journal,
        progress=progress,
        rehash_source=rehash_source,
        arrived=arrivals.arrived if arrivals else None,
        done=arrivals.release if isinstance(arrivals, BudgetedArrivals) else None,
    )
    if arrivals is not None:
        arrivals.finish()
    extra = [e for role, cp in checkpoints.items() for e in _copy_extras(cp, out, role)]
    with no_cycle_collection():
        manifest = manifest_of(plan, checkpoints, sources, journal.done, source_hashes, extra)
        manifest = dataclasses.replace(
            manifest, request=request, plan_fingerprint=journal.fingerprint
        )
        mf.write_manifest(out, manifest)
    journal.remove()
    return manifest


def _copy_extras(checkpoint: Checkpoint, out: Path, role: str) -> list[mf.ExtraFile]:
    folder = out if role == "target" else out / "draft"
    folder.mkdir(parents=True, exist_ok=True)
    copied = []
    names = sorted({p.name for pat in COPIED_FILE_PATTERNS for p in checkpoint.root.glob(pat)})
    names = sorted({*names, *checkpoint.side_files()})
    for name in names:
        src = checkpoint.root / name
        if not src.is_file():
            continue
        tmp = folder / (name + INCOMPLETE_SUFFIX)
        safefs.copy_new(src, tmp)  # never through a link planted at either name
        os.replace(tmp, folder / name)
        rel = name if role == "target" else f"draft/{name}"
        copied.append(mf.ExtraFile(rel, src.stat().st_size, sha256_file(folder / name)))
    return copied
