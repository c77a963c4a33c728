"""What `verify --full` replays: the conversion the manifest records, checked against the
artifact the manifest lists (every stage and every model of it, never less), read at the
commits it records, with the Hub source files it needs downloaded (into the cache, or
within a budget into a temporary folder)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

from shardprep.convert.checkpoint import Checkpoint
from shardprep.convert.hub_budget import start_budgeted_fetch
from shardprep.convert.hub_source import Arrivals, files_for_plan
from shardprep.convert.journal import plan_differences
from shardprep.convert.run import Options, load_and_plan
from shardprep.errors import ConfigError, ManifestError, ShardprepError, summarize
from shardprep.format import manifest as mf
from shardprep.format.cut_names import MXFP4_PADDING_AT_LOAD
from shardprep.format.dtypes import MODEL_DTYPES
from shardprep.plan.records import Plan
from shardprep.report import format_bytes


class Disagreement(ManifestError):
    """The manifest's recorded request, or what replaying it plans, is not the artifact
    the manifest lists."""


def legacy_request(manifest: mf.Manifest, target: mf.ModelEntry) -> mf.ConversionRequest:
    """The request of an artifact made before the manifest recorded it, rebuilt from the
    fields that record its effects. A draft whose source is the target's own checkpoint
    (MTP layers) was not given with --draft; no draft at all means none was converted."""
    draft = manifest.model("draft")
    topo = manifest.topology
    given = draft is not None and draft.source.model != target.source.model
    return mf.ConversionRequest(
        tp=topo.tp,
        pp=topo.pp,
        draft=draft.source.model if draft is not None and given else None,
        draft_method=draft.method if draft is not None and given else None,
        partition=",".join(map(str, topo.partition)),
        stage=manifest.stages[0] if len(manifest.stages) == 1 and topo.pp > 1 else None,
        dtype=next(name for name, code in MODEL_DTYPES.items() if code == target.dtype),
        revision=target.source.revision,
        expert_parallel=topo.expert_parallel,
        expert_placement=target.experts.requested_placement if target.experts else "linear",
        dp=target.experts.dp if target.experts else 1,
        mtp_draft=draft is not None,
        mxfp4_pad=_baked_mxfp4_pad(target),
    )


def _baked_mxfp4_pad(target: mf.ModelEntry) -> str | None:
    """The --mxfp4-pad the experts' padding records; None where nothing is baked in."""
    padding = target.experts.assumptions.get("mxfp4_padding") if target.experts else None
    return None if padding == MXFP4_PADDING_AT_LOAD else padding


def replay(manifest: mf.Manifest, out: Path) -> tuple[Plan, dict[str, Checkpoint]]:
    """The plan of the recorded request at the recorded commits, and its checkpoints;
    `Disagreement` when the request or that plan is not what the manifest lists."""
    target = manifest.model("target")
    if target is None:
        raise ShardprepError(f"{out} has no target model in its manifest")
    request = manifest.request or legacy_request(manifest, target)
    found = request_disagreements(manifest, target, request)
    if found:
        raise Disagreement(
            f"the request its manifest records disagrees with the artifact it lists "
            f"({'; '.join(found[:3])})"
        )
    _check_offline(manifest)
    draft = manifest.model("draft")
    options = Options(
        **{
            **request.__dict__,
            "revision": target.source.revision if target.source.repo_id else request.revision,
        },
        draft_revision=draft.source.revision if draft and draft.source.repo_id else None,
    )
    plan, checkpoints = load_and_plan(target.source.repo_id or target.source.model, options)
    differences = plan_differences(manifest, plan, checkpoints)
    if differences:
        raise Disagreement(
            "replaying the request its manifest records plans another artifact than the one "
            f"it lists (the manifest: {'; '.join(differences[:3])})"
        )
    return plan, checkpoints


def _check_offline(manifest: mf.Manifest) -> None:
    """With HF_HUB_OFFLINE, a Hub source's files must all be in the Hugging Face cache
    already: the replay reads every header (and the round trip the tensors)."""
    from shardprep import hub_client  # imports huggingface_hub: only a Hub source needs it

    if not hub_client.is_offline():
        return
    from huggingface_hub import try_to_load_from_cache

    for model in manifest.models:
        repo, commit = model.source.repo_id, model.source.revision
        if repo is None or commit is None:
            continue
        missing = [
            f.path
            for f in model.source.files
            if not isinstance(try_to_load_from_cache(repo, f.path, revision=commit), str)
        ]
        if missing:
            raise ConfigError(
                f"HF_HUB_OFFLINE is set and the Hugging Face cache lacks {summarize(missing)} "
                f"of {repo}@{commit[:12]}, which verify --full rebuilds the {model.role} from; "
                f"unset HF_HUB_OFFLINE so that it downloads them, or download them first "
                f"(`hf download {repo} --revision {commit}`)"
            )


def request_disagreements(
    manifest: mf.Manifest, target: mf.ModelEntry, request: mf.ConversionRequest
) -> list[str]:
    """Where the recorded request and the artifact the manifest lists differ, each side
    named."""
    topo = manifest.topology
    found = [
        f"the request asks for {name}={asked}, the manifest lists {name}={listed}"
        for name, asked, listed in (("tp", request.tp, topo.tp), ("pp", request.pp, topo.pp))
        if asked != listed
    ]
    partition = ",".join(map(str, topo.partition))
    if request.partition is not None and request.partition.replace(" ", "") != partition:
        found.append(
            f"the request asks for the partition {request.partition}, the manifest lists "
            f"{partition}"
        )
    stages = tuple(range(request.pp)) if request.stage is None else (request.stage,)
    if stages != tuple(manifest.stages):
        found.append(f"the request asks for {_stages(stages)}, the manifest lists "
                     f"{_stages(tuple(manifest.stages))}")  # fmt: skip
    found += _draft_disagreements(manifest, target, request)
    if request.expert_parallel != topo.expert_parallel:
        found.append(
            f"the request asks for expert parallelism {_on(request.expert_parallel)}, the "
            f"manifest lists it {_on(topo.expert_parallel)}"
        )
    experts = target.experts
    if request.dp != (experts.dp if experts else 1):
        listed = f"dp={experts.dp}" if experts else "no experts, the same on every dp rank"
        found.append(f"the request asks for dp={request.dp}, the manifest lists {listed}")
    if request.mxfp4_pad is not None and not (experts and "mxfp4_padding" in experts.assumptions):
        found.append(
            f"the request asks for the MXFP4 padding {request.mxfp4_pad}, the manifest lists "
            "no MXFP4 experts"
        )
    elif request.mxfp4_pad != _baked_mxfp4_pad(target) and experts is not None:
        found.append(
            f"the request asks for the MXFP4 padding {request.mxfp4_pad or 'none'}, the "
            f"manifest lists {_baked_mxfp4_pad(target) or 'none baked in'}"
        )
    return found


def _draft_disagreements(
    manifest: mf.Manifest, target: mf.ModelEntry, request: mf.ConversionRequest
) -> list[str]:
    draft = manifest.model("draft")
    internal = draft is not None and draft.source.model == target.source.model
    if draft is None:
        listed = "no draft"
    elif internal:
        listed = "the draft inside the target checkpoint"
    else:
        listed = f"the draft {draft.source.model}"
    if request.draft is not None and (draft is None or request.draft != draft.source.model):
        return [f"the request names the draft {request.draft}, the manifest lists {listed}"]
    if request.draft is None and draft is not None and not internal:
        return [f"the request names no draft, the manifest lists {listed}"]
    if request.draft is None and internal and not request.mtp_draft:
        return [f"the request leaves the draft out (--no-mtp), the manifest lists {listed}"]
    if draft is not None and request.draft_method not in (None, draft.method):
        return [
            f"the request names the draft method {request.draft_method}, the manifest lists "
            f"{draft.method}"
        ]
    return []


def _stages(stages: tuple[int, ...]) -> str:
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def _on(value: bool) -> str:
    return "on" if value else "off"


def sources_in_turn(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    wanted: dict[int, set[str]],
    budget: int | None,
    progress: bool = False,
    watch: Callable[[], None] | None = None,
) -> Generator[tuple[int, Checkpoint, str], None, None]:
    """Each file of `wanted` (files by `id` of their checkpoint) once it is on disk, with
    the checkpoint to read it from: a local source's where it is; a Hub source's from the
    Hugging Face cache, which gets the files it lacks (each checked against the sha256 the
    Hub states, as convert's are); or, with `budget`, from a temporary folder that holds at
    most `budget` bytes of them, each deleted when the caller asks for the next."""
    for key, checkpoint in {id(cp): cp for cp in checkpoints.values()}.items():
        files = sorted(wanted.get(key, ()))
        missing = [f for f in files if not (checkpoint.root / f).exists()]
        if checkpoint.remote is not None and missing and budget is not None:
            roles = [role for role, cp in checkpoints.items() if cp is checkpoint]
            yield from _budgeted(plan, checkpoint, roles, key, set(files), budget, progress, watch)
            continue
        if checkpoint.remote is not None and missing:
            _fetch_into_cache(checkpoint, missing, progress)
        yield from ((key, checkpoint, file) for file in files)


def _budgeted(
    plan: Plan,
    checkpoint: Checkpoint,
    roles: list[str],
    key: int,
    files: set[str],
    budget: int,
    progress: bool,
    watch: Callable[[], None] | None,
) -> Iterator[tuple[int, Checkpoint, str]]:
    with tempfile.TemporaryDirectory(prefix="shardprep-verify-", ignore_cleanup_errors=True) as tmp:
        arrivals, private = start_budgeted_fetch(
            plan, dict.fromkeys(roles, checkpoint), Path(tmp), budget, watch, progress=progress
        )
        ok = False
        try:
            here = private[roles[0]]
            for batch in arrivals.arrived(here, files_for_plan(plan, checkpoint, roles)):
                for file in batch:
                    if file in files:
                        yield key, here, file
                    arrivals.release(here, file)
            arrivals.finish()
            ok = True
        finally:
            arrivals.close(wait=ok)  # a failed one does not wait for the transfers left


def _fetch_into_cache(checkpoint: Checkpoint, missing: list[str], progress: bool) -> None:
    size = sum(checkpoint.size(f) for f in missing)
    free = shutil.disk_usage(checkpoint.root).free
    if size > free:
        raise ConfigError(
            f"verify --full rebuilds every tensor from {checkpoint.repo_id}@"
            f"{(checkpoint.revision or '')[:12]}, and {summarize(missing)} "
            f"({format_bytes(size)}) {'are' if len(missing) > 1 else 'is'} not in the "
            f"Hugging Face cache, whose disk has {format_bytes(free)} free; pass "
            "--source-budget SIZE to download them a few at a time into a temporary folder, "
            "or free some space or point HF_HUB_CACHE at a larger disk"
        )
    arrivals = Arrivals(progress)  # `hub_source.fetch`, with a bar of the bytes
    try:
        arrivals.expect([(checkpoint, missing)])
        arrivals.submit(checkpoint, missing)
        arrivals.finish()
    finally:
        arrivals.close()
