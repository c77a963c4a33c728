"""Source headers + topology + architecture rules -> what goes in every rank file.

Pure data: no byte of a weight is touched here, so a 1 TB model plans in milliseconds
and every check runs before the first write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardprep.constants import (
    DP_SHARD_PATTERN,
    DRAFT_DIR,
    SHARD_PATTERN,
    SHARDS_DIR,
)
from shardprep.errors import ConfigError, PlanError
from shardprep.format.cut_names import MXFP4_PADDING_AT_LOAD
from shardprep.format.dtypes import FLOAT_DTYPES, MODEL_DTYPES
from shardprep.format.records import Topology
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import Family, Layout, Param, PlanContext, config_int
from shardprep.plan.checks import (
    checked_layout,
    expert_flag_problems,
    problem_summary,
    request_problems,
)
from shardprep.plan.cuts import MODEL_DTYPE, Block, Cut
from shardprep.plan.drafts import accepted_draft_problems
from shardprep.plan.experts import StackKinds, expert_stack, is_expert_stack
from shardprep.plan.layout import block_shape, piece_blocks
from shardprep.plan.quant import Mxfp4Quant, scheme_of
from shardprep.plan.quant.backend_pad import pads_by_backend
from shardprep.plan.records import (
    ExpertPlan,
    FilePlan,
    ModelPlan,
    Plan,
    SourceModel,
    TensorPlan,
)
from shardprep.plan.topology import ExpertSplit, effective_placement, make_topology


def resolve_dtype(requested: str, config: Mapping[str, Any], source: SourceModel) -> str:
    """The safetensors dtype of vLLM's parameters: --dtype, else what vLLM's `auto` picks:
    config.json's torch_dtype, with float32 served as bfloat16 (vLLM downcasts float32
    checkpoints), else the most common floating dtype of the checkpoint."""
    name = requested
    if requested == "auto":
        name = str(config.get("torch_dtype") or config.get("dtype") or "")
        if not name:
            floats = [d for d, _ in source.tensors.values() if d in FLOAT_DTYPES]
            name = max(set(floats), key=floats.count) if floats else "F32"
            name = {v: k for k, v in MODEL_DTYPES.items()}.get(name, "float32")
        if name == "float32":
            name = "bfloat16"
    if name not in MODEL_DTYPES:
        raise ConfigError(
            f"dtype {name!r} is not supported; choose one of auto, {', '.join(MODEL_DTYPES)}"
        )
    return MODEL_DTYPES[name]


@dataclass(frozen=True)
class _Job:
    """One model to plan: its role, the name the manifest records (architecture or draft
    method), its family, its checkpoint and what its hooks know of the conversion."""

    role: str
    architecture: str
    method: str | None
    family: Family
    source: SourceModel
    ctx: PlanContext


def make_plan(
    target: SourceModel,
    request: ConversionRequest,
    draft: SourceModel | None = None,
    *,
    partition_origin: str = "",
    distinct_copies: frozenset[str] | Callable[[], frozenset[str]] = frozenset(),
) -> Plan:
    """Validate everything, then lay out every rank file as `request` asks (its
    `draft_method` names the kind of `draft`; None: the draft's config and tensors tell).
    Raises one PlanError listing every problem found. `partition_origin` names where
    `request.partition` came from when it was not the command line; `distinct_copies`:
    the draft's copies of target tensors (`DraftFamily.shared_copies`) whose bytes differ
    from the target's, so the draft must hold them itself (or a call that waits for them:
    the bytes are compared while the target is planned)."""
    effective_placement(request.expert_placement, num_expert_group=None, dp=1)  # raises
    target = SourceModel(archs.read_config(target.config), target.tensors)
    if draft is not None:
        draft = SourceModel(archs.read_config(draft.config), draft.tensors)
    if request.dp < 1:
        raise PlanError(f"data parallel size must be at least 1, got --dp {request.dp}")
    architecture, family = archs.target_family(target.config)
    problems: list[str] = []
    topology = _topology(target, request, partition_origin, problems)
    model_dtype = resolve_dtype(request.dtype, target.config, target)
    problems += request_problems(target, request)
    jobs = _jobs((architecture, family), target, draft, request)
    problems += [f"target: {p}" for p in accepted_draft_problems(family, jobs[-1].method)]
    layouts = []
    for i, job in enumerate(jobs):
        if job.role == "draft":
            copies = distinct_copies() if callable(distinct_copies) else distinct_copies
            jobs[i] = job = replace(job, ctx=replace(job.ctx, distinct_copies=copies))
        layout, found = checked_layout(
            job.role, job.family, job.source, request.tp, topology, job.ctx
        )
        problems += found
        layouts.append(layout)
    problems += expert_flag_problems(architecture, request, layouts)
    if problems or topology is None:
        raise PlanError(problem_summary(problems))
    return _plan(topology, request, jobs, layouts, model_dtype)


def _topology(
    target: SourceModel, request: ConversionRequest, origin: str, problems: list[str]
) -> Topology | None:
    """The topology the request asks for; None, with the problem noted, if it is invalid."""
    num_layers = config_int(target.config, "num_hidden_layers")
    try:
        return make_topology(num_layers, request.tp, request.pp, request.partition, origin)
    except PlanError as exc:
        problems.append(str(exc))
        return None


def _jobs(
    target_family: tuple[str, Family],
    target: SourceModel,
    draft: SourceModel | None,
    request: ConversionRequest,
) -> list[_Job]:
    """The target, and its draft if there is one, each with its family and context."""
    architecture, family = target_family
    moe = PlanContext(
        pp=request.pp,
        dp=request.dp,
        mxfp4_pad=request.mxfp4_pad,
        expert_parallel=request.expert_parallel,
        dtypes=target.dtypes,
    )
    if draft is None:
        return [_Job("target", architecture, None, family, target, moe)]
    method = request.draft_method or archs.detect_draft_method(
        draft.config, sorted(draft.tensors), family.name
    )
    draft_family = archs.draft_family(method, family.name)
    shares = draft_family.shares_target_embedding
    target_ctx = replace(
        moe, draft_method=method, draft_shares_embedding=shares, draft_config=draft.config
    )
    draft_ctx = replace(
        moe,
        target_config=target.config,
        draft_names=tuple(sorted(draft.tensors)),
        dtypes=draft.dtypes,
    )
    return [
        _Job("target", architecture, None, family, target, target_ctx),
        _Job("draft", method, method, draft_family, draft, draft_ctx),
    ]


def _plan(
    topology: Topology,
    request: ConversionRequest,
    jobs: list[_Job],
    layouts: list[Layout | None],
    model_dtype: str,
) -> Plan:
    """Every model's record and rank files (a draft's on the last stage only)."""
    pp = request.pp
    stages = tuple(range(pp)) if request.stage is None else (request.stage,)
    models: list[ModelPlan] = []
    files: list[FilePlan] = []
    problems: list[str] = []
    for job, layout in zip(jobs, layouts, strict=True):
        assert layout is not None
        models.append(_model_plan(job, layout, request, model_dtype))
        model_stages = stages if job.role == "target" else tuple(s for s in stages if s == pp - 1)
        mine = _rank_files(
            models[-1], layout, job.source, model_stages, request.tp, request.max_part_bytes
        )
        found = job.family.rank_file_problems(job.source, models[-1], mine, topology)
        problems += [f"{job.role}: {problem}" for problem in found]
        files += mine
    if problems:
        raise PlanError(problem_summary(problems))
    return Plan(topology, stages, tuple(models), tuple(files))


def _model_plan(
    job: _Job, layout: Layout, request: ConversionRequest, model_dtype: str
) -> ModelPlan:
    source = job.source
    scheme = scheme_of(source.config, request.mxfp4_pad)
    scheme = job.family.quant_scheme(scheme) if scheme is not None else None
    experts = _expert_plan(
        layout, request.tp, request.dp, request.expert_parallel, request.expert_placement, scheme
    )
    return ModelPlan(
        role=job.role,
        architecture=job.architecture,
        method=job.method,
        dtype=model_dtype,
        folder="" if job.role == "target" else DRAFT_DIR,
        num_layers=int(source.config.get("num_hidden_layers", 0)),
        spec_decode_only=tuple(sorted(layout.spec_decode_only)),
        shared_with_target=tuple(sorted(layout.shared_with_target)),
        skipped=tuple(sorted(layout.skipped.items())),
        experts=experts,
        family=job.family.name,
        quantization=scheme.method if scheme else None,
        scheme=scheme.name if scheme else None,
        pieces=tuple(sorted({p.name: p.pieces for p in layout.params}.items())),
        source_shapes=tuple(
            sorted(
                {
                    piece.source: tuple(source.tensors[piece.source][1])
                    for param in layout.params
                    for piece in param.pieces
                }.items()
            )
        ),
    )


def _expert_plan(
    layout: Layout, tp: int, dp: int, expert_parallel: bool, requested: str, scheme: Any
) -> ExpertPlan | None:
    if not layout.num_experts:
        return None
    placement = effective_placement(requested, num_expert_group=layout.num_expert_group, dp=dp)
    split = ExpertSplit(layout.num_experts, tp, dp, expert_parallel, placement)
    assumptions: tuple[tuple[str, str], ...] = ()
    if scheme is not None and pads_by_backend(scheme.method):  # MXFP4 experts
        padding = scheme.padding if isinstance(scheme, Mxfp4Quant) else MXFP4_PADDING_AT_LOAD
        assumptions = (("mxfp4_padding", padding),)
    return ExpertPlan(split, requested, assumptions)


def _rank_files(
    model: ModelPlan,
    layout: Layout,
    source: SourceModel,
    stages: tuple[int, ...],
    tp: int,
    max_part_bytes: int,
) -> list[FilePlan]:
    """The files of every (stage, tp rank). With dp > 1 the expert stacks differ per dp
    rank: they go to files of their own per (stage, tp rank, dp rank), each holding the
    experts of MoE rank dp_rank * tp + tp_rank, and the rest is stored once."""
    files: list[FilePlan] = []
    experts = model.experts.split if model.experts else ExpertSplit(0, tp)
    for pp_rank in stages:
        params = [param for param in layout.params if pp_rank in param.stages]
        kinds = {
            id(p): StackKinds.of(p.pieces, source.shapes)
            for p in params
            if is_expert_stack(p.pieces)
        }
        stacks = [p for p in params if id(p) in kinds] if experts.dp > 1 else []
        separate = {id(param) for param in stacks}
        for tp_rank in range(tp):
            tensors = [
                tensor_plan(
                    param, source, tp, tp_rank, model.dtype, experts, tp_rank, kinds.get(id(param))
                )
                for param in params
                if id(param) not in separate
            ]
            files += _split_parts(
                model.folder, model.role, pp_rank, tp_rank, tensors, max_part_bytes
            )
            for dp_rank in range(experts.dp) if stacks else ():
                moe_rank = experts.moe_rank(tp_rank, dp_rank)
                tensors = [
                    tensor_plan(
                        param, source, tp, tp_rank, model.dtype, experts, moe_rank, kinds[id(param)]
                    )
                    for param in stacks
                ]
                files += _split_parts(
                    model.folder, model.role, pp_rank, tp_rank, tensors, max_part_bytes, dp_rank
                )
    return files


def tensor_plan(
    param: Param,
    source: SourceModel,
    tp: int,
    rank: int,
    model_dtype: str,
    experts: ExpertSplit,
    moe_rank: int,
    kinds: StackKinds | None = None,
) -> TensorPlan:
    """One parameter of tp rank `rank`; an expert stack holds the experts of `moe_rank`
    (`kinds`: its pieces' kinds, when worked out already for the other ranks)."""
    source_dtype = source.tensors[param.pieces[0].source][0]
    dtype = param.dtype or (model_dtype if source_dtype in FLOAT_DTYPES else source_dtype)
    if dtype == MODEL_DTYPE:
        dtype = model_dtype
    if is_expert_stack(param.pieces):
        try:
            kinds = kinds or StackKinds.of(param.pieces, source.shapes)
            stack, shape = expert_stack(param.name, kinds, source.shapes, experts, moe_rank)
        except PlanError as exc:
            raise PlanError(f"{param.name}: {exc}") from None
        return TensorPlan(param.name, dtype, shape, stack, experts=shape[0])
    blocks: list[Block] = []
    for piece in param.pieces:
        if piece.cut is Cut.ALIGN_ROWS:  # depends on the rank's rows so far, so on tp
            if padding := -sum(b.height for b in blocks) % piece.heads:
                blocks.append(Block(None, (0, padding)))
            continue
        try:
            blocks += piece_blocks(piece, source.tensors[piece.source][1], tp, rank)
        except PlanError as exc:
            raise PlanError(f"{param.name}: {exc}") from None
    first_shape = source.tensors[param.pieces[0].source][1]
    if param.pieces[0].cut is Cut.PER_TENSOR:  # one value per piece, scalar or [1]
        shape = (len(blocks),)
    elif param.pieces[0].cut is Cut.SCALAR:
        shape = ()
    elif first_shape:
        trailing = block_shape(blocks[0], first_shape)[1:]
        shape = (sum(b.height for b in blocks), *trailing)
    else:
        shape = ()
    return TensorPlan(param.name, dtype, shape, tuple(blocks))


def _split_parts(
    folder: str,
    role: str,
    pp: int,
    tp: int,
    tensors: Sequence[TensorPlan],
    max_part_bytes: int,
    dp: int | None = None,
) -> list[FilePlan]:
    """Greedy: a tensor starts a new part when it would push the current one over the
    limit; a tensor is never split across parts. `dp`: the files of that dp rank's
    experts (their parts count from 0 too)."""
    parts: list[list[TensorPlan]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor.spec.nbytes
        if parts[-1] and size + nbytes > max_part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(tensor)
        size += nbytes
    prefix = f"{folder}/{SHARDS_DIR}" if folder else SHARDS_DIR
    pattern = SHARD_PATTERN if dp is None else DP_SHARD_PATTERN
    return [
        FilePlan(
            f"{prefix}/{pattern.format(pp=pp, tp=tp, dp=dp, part=i)}",
            role,
            pp,
            tp,
            i,
            tuple(part),
            dp,
        )
        for i, part in enumerate(parts)
    ]
