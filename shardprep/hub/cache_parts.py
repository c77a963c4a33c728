"""Which parts of an artifact a fetch asks for: the request checked, the stages (or one
rank of them) it names, those of another pipeline split, and each part's files."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from shardprep import hub_client
from shardprep.constants import ENV_PP_PARTITION, pp_partition_from_env
from shardprep.errors import ConfigError, PlanError, TopologyMismatchError
from shardprep.format.manifest import Manifest, ModelEntry
from shardprep.hub.cache_state import Part, Wanted
from shardprep.plan.regions import expert_ranks_for, stages_for, tp_ranks_for
from shardprep.plan.topology import ExpertSplit, default_partition, parse_partition

RunningSplit = Callable[[ModelEntry], tuple[ExpertSplit, int] | None]
"""Given the manifest's entry of a model with experts, vLLM's expert split on this worker
and its MoE rank (None where vLLM built no expert layer)."""


def check_request(
    stage: int | None,
    rank: int | None,
    all_stages: bool,
    pp: int | None = None,
    tp: int | None = None,
) -> None:
    if all_stages and (stage is not None or rank is not None or pp is not None or tp is not None):
        raise ConfigError("--all fetches every stage and rank: drop --stage, --rank, --pp and --tp")
    if pp is not None and stage is None:
        raise ConfigError(f"--pp {pp} needs --stage: say which stage of the {pp} to fetch")
    if pp is not None and pp < 1:
        raise ConfigError(f"--pp {pp} is not a pipeline size; pass 1 or more")
    if tp is not None and rank is None:
        raise ConfigError(f"--tp {tp} needs --rank: say which rank of the {tp} to fetch")
    if tp is not None and tp < 1:
        raise ConfigError(f"--tp {tp} is not a tensor parallel size; pass 1 or more")
    if rank is not None and stage is None:
        raise ConfigError(f"--rank {rank} needs --stage: say which stage's rank to fetch")
    for name, value in (("stage", stage), ("rank", rank)):
        if value is not None and value < 0:
            raise ConfigError(f"--{name} {value} is negative; stages and ranks count from 0")


def requested_parts(
    manifest: Manifest, repo_id: str, stage: int | None, rank: int | None, all_stages: bool
) -> list[Part]:
    stages, topo = list(manifest.stages), manifest.topology
    if all_stages:
        return [Part(p) for p in stages]
    if stage is None:
        if topo.pp == 1 and stages == [0]:
            return [Part(0)]
        raise ConfigError(
            f"{repo_id} is split into {topo.pp} pipeline stages: pass --stage P (the stage this "
            f"node serves, one of {', '.join(map(str, stages))}) or --all"
        )
    if stage not in stages:
        raise ConfigError(
            f"{repo_id} holds stage(s) {', '.join(map(str, stages))} of pp={topo.pp}, not "
            f"stage {stage}; pass one of those to --stage"
        )
    if rank is not None and rank >= topo.tp:
        raise ConfigError(
            f"{repo_id} was built for tp={topo.tp}: --rank takes 0 to {topo.tp - 1}, not {rank}"
        )
    return [Part(stage, rank)]


def split_parts(
    manifest: Manifest,
    repo_id: str,
    stage: int,
    rank: int | None,
    *,
    pp: int | None = None,
    tp: int | None = None,
    partition: Sequence[int] | None = None,
    expert_ranks: Collection[int] | None = None,
) -> list[Part]:
    """The artifact's parts that rank `rank` (None: every rank) of stage `stage` reads when
    vLLM runs at tp x pp: `partition` (layers per stage), else that of `pp`
    (VLLM_PP_LAYER_PARTITION, else vLLM's default), else the artifact's own; tp defaults to
    the artifact's. For a model with experts, which ranks hold a rank's experts depends on
    the expert parallelism vLLM runs with: `expert_ranks` (the artifact tp ranks that hold
    them, `worker_expert_ranks`) are read too; without them, whole stages."""
    topo = manifest.topology
    tp = topo.tp if tp is None else tp
    layers, env = sum(topo.partition), pp_partition_from_env()
    flag = f"--pp {pp}" if pp is not None else f"--tp {tp}"
    try:
        if partition is None:
            partition = tuple(topo.partition) if pp is None else _split(layers, pp, env)
        partition = tuple(partition)
        if (tp, partition) == (topo.tp, tuple(topo.partition)):
            return requested_parts(manifest, repo_id, stage, rank, False)
        if not manifest.served_tps:
            raise ConfigError(
                f"{repo_id} is tp{topo.tp} x pp{topo.pp} and serves "
                f"{manifest.served_topologies()}: fetch one of its own stages and ranks "
                "(drop --pp and --tp)"
            )
        stages = stages_for(topo, partition, stage)
        if rank is None:
            return [Part(p) for p in stages]
        ranks: Sequence[int] = tp_ranks_for(topo.tp, tp, rank)
    except PlanError as exc:
        raise ConfigError(f"{repo_id} at {flag}: {exc}") from None
    if any(m.experts is not None for m in manifest.models):
        if expert_ranks is None:
            return [Part(p) for p in stages]
        ranks = sorted({*ranks, *expert_ranks})
    return [Part(p, r) for p in stages for r in ranks]


def _split(layers: int, pp: int, env: str | None) -> tuple[int, ...]:
    """The layers per stage at `pp` stages: VLLM_PP_LAYER_PARTITION's, else vLLM's split."""
    if env:
        return parse_partition(env, layers, pp, ENV_PP_PARTITION)
    return default_partition(layers, pp)


def worker_parts(
    manifest: Manifest,
    repo_id: str,
    role: str,
    stage: int,
    tp: int,
    tp_rank: int,
    partition: Sequence[int] | None,
    experts: RunningSplit | None = None,
) -> list[Part]:
    """What the vLLM worker at `stage` of the pipeline split `partition` (vLLM's; None for
    a draft, which lives on the artifact's last stage), tp rank `tp_rank` of `tp`, reads.
    `experts`: how vLLM spreads the experts of `role` on this worker (`RunningSplit`);
    without it a model with experts is read from whole stages."""
    topo = manifest.topology
    split = tuple(topo.partition) if partition is None else tuple(partition)
    own = (tp, split) == (topo.tp, tuple(topo.partition))
    if not own and tp not in manifest.served_tps:
        raise TopologyMismatchError(
            f"{repo_id} is tp{topo.tp} x pp{topo.pp} and serves {manifest.served_topologies()}; "
            f"vLLM runs tp{tp} x pp{len(split)} (layers {','.join(map(str, split))}), which it "
            f"cannot serve; start vLLM at a topology it serves, or convert again with --tp {tp} "
            f"--pp {len(split)}"
        )
    ranks = None if own else worker_expert_ranks(manifest, repo_id, role, experts)
    if role == "draft":  # on the last stage of any split: the artifact's last stage
        return split_parts(manifest, repo_id, topo.last_stage, tp_rank, tp=tp, expert_ranks=ranks)
    return split_parts(
        manifest, repo_id, stage, tp_rank, tp=tp, partition=split, expert_ranks=ranks
    )


def worker_expert_ranks(
    manifest: Manifest, repo_id: str, role: str, experts: RunningSplit | None
) -> tuple[int, ...] | None:
    """The artifact tp ranks whose files hold the experts of `role` that this worker reads
    (`expert_ranks_for`): () for a model without experts, None where that is not known."""
    entry = manifest.model(role)
    if entry is None or entry.experts is None:
        return ()
    running = experts(entry) if experts is not None else None
    if running is None:
        return None
    e, topo = entry.experts, manifest.topology
    stored = ExpertSplit(e.num_experts, topo.tp, e.dp, e.expert_parallel, e.placement)
    try:
        found = expert_ranks_for(stored, *running)
    except PlanError as exc:
        raise TopologyMismatchError(f"{repo_id}: {exc}") from None
    return tuple(sorted({moe_rank % topo.tp for moe_rank in found}))


def wanted_files(manifest: Manifest, part: Part) -> list[Wanted]:
    """The part's rank files (every role: the draft lives on the last stage) and the extras."""
    items = []
    for f in manifest.files:
        if f.pp != part.stage or (part.rank is not None and f.tp != part.rank):
            continue
        stored = hub_client.stored_path(f)
        packed = f.codec != "none"
        items.append(
            Wanted(
                path=f.path,
                bytes=f.bytes,
                sha256=f.sha256,
                stored=stored,
                stored_bytes=f.stored_bytes if packed and f.stored_bytes is not None else f.bytes,
                stored_sha256=f.stored_sha256 if packed and f.stored_sha256 else f.sha256,
                codec=f.codec,
            )
        )
    for e in manifest.side_files:
        items.append(Wanted(e.path, e.bytes, e.sha256, e.path, e.bytes, e.sha256, "none"))
    return items
