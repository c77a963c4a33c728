"""What `verify --full` replays: the conversion the manifest records, checked against the
artifact the manifest lists (every stage and every model of it, never less), read at the
commits it records, with the Hub source files it needs downloaded into the cache."""

from __future__ import annotations

import shutil
from pathlib import Path

from shardprep.convert.checkpoint import Checkpoint
from shardprep.convert.hub_source import fetch
from shardprep.convert.journal import plan_differences
from shardprep.convert.run import Options, load_and_plan
from shardprep.errors import ConfigError, ShardprepError, summarize
from shardprep.format import manifest as mf
from shardprep.format.dtypes import MODEL_DTYPES
from shardprep.plan.records import Plan
from shardprep.report import format_bytes


class Disagreement(ShardprepError):
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
        mxfp4_pad=(target.experts.assumptions.get("mxfp4_padding") if target.experts else None),
    )


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
    if target.experts is not None and request.dp != target.experts.dp:
        found.append(f"the request asks for dp={request.dp}, the manifest lists "
                     f"dp={target.experts.dp}")  # fmt: skip
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


def fetch_sources(
    plan: Plan, checkpoints: dict[str, Checkpoint], units: set[tuple[int, int]]
) -> None:
    """Download into the Hugging Face cache the files of each Hub source that the rank
    files of `units` were cut from and that the cache lacks (each checked against the
    sha256 the Hub states, as convert's are); refuse in one line when they would not fit
    on the cache's disk."""
    wanted: dict[int, tuple[Checkpoint, set[str]]] = {}
    for file in plan.files:
        checkpoint = checkpoints[file.role]
        if (file.pp, file.tp) not in units or checkpoint.remote is None:
            continue
        names = wanted.setdefault(id(checkpoint), (checkpoint, set()))[1]
        names |= {
            checkpoint.tensors[block.source].file
            for tensor in file.tensors
            for block in tensor.blocks
            if block.source is not None and block.source not in checkpoint.side_tensors
        }
    for checkpoint, names in wanted.values():
        missing = sorted(f for f in names if not (checkpoint.root / f).exists())
        if not missing:
            continue
        size = sum(checkpoint.size(f) for f in missing)
        free = shutil.disk_usage(checkpoint.root).free
        if size > free:
            raise ConfigError(
                f"verify --full rebuilds every tensor from {checkpoint.repo_id}@"
                f"{(checkpoint.revision or '')[:12]}, and {summarize(missing)} "
                f"({format_bytes(size)}) {'are' if len(missing) > 1 else 'is'} not in the "
                f"Hugging Face cache, whose disk has {format_bytes(free)} free; free some "
                "space or point HF_HUB_CACHE at a larger disk, then rerun"
            )
        fetch(checkpoint, missing)
