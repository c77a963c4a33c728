"""Source headers + topology + architecture rules -> what goes in every rank file.

Pure data: no byte of a weight is touched here, so a 1 TB model plans in milliseconds
and every check runs before the first write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardprep.constants import (
    DEFAULT_MAX_PART_BYTES,
    DP_SHARD_PATTERN,
    DRAFT_DIR,
    SHARD_PATTERN,
    SHARDS_DIR,
)
from shardprep.errors import ConfigError, PlanError
from shardprep.format.cut_names import MXFP4_PADDING_AT_LOAD
from shardprep.format.dtypes import FLOAT_DTYPES, MODEL_DTYPES
from shardprep.format.records import Topology
from shardprep.plan import archs
from shardprep.plan.archs.base import Family, Layout, Param, config_int
from shardprep.plan.checks import checked_layout, dp_problems, problem_summary
from shardprep.plan.cuts import MODEL_DTYPE, Block, Cut
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


def make_plan(
    target: SourceModel,
    *,
    tp: int,
    pp: int,
    draft: SourceModel | None = None,
    draft_method: str | None = None,
    partition: str | None = None,
    stage: int | None = None,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    dtype: str = "auto",
    partition_origin: str = "",
    expert_parallel: bool = False,
    expert_placement: str = "linear",
    dp: int = 1,
    distinct_copies: frozenset[str] = frozenset(),
    mxfp4_pad: str | None = None,
) -> Plan:
    """Validate everything, then lay out every rank file. Raises one PlanError listing
    every problem found. `partition_origin` names where `partition` came from when it
    was not the command line; `expert_parallel`, `expert_placement` and `dp` are vLLM's
    --enable-expert-parallel, --expert-placement-strategy and --data-parallel-size;
    `mxfp4_pad` an MXFP4 MoE backend's padding to bake in (`--mxfp4-pad`; None: the
    stacks unpadded, padded at load for the backend that runs).
    `distinct_copies`: the draft's copies of target tensors (`DraftFamily.shared_copies`)
    whose bytes differ from the target's, so the draft must hold them itself."""
    effective_placement(expert_placement, num_expert_group=None, dp=1)  # raises if unknown
    target = SourceModel(archs.read_config(target.config), target.tensors)
    if draft is not None:
        draft = SourceModel(archs.read_config(draft.config), draft.tensors)
    if dp < 1:
        raise PlanError(f"data parallel size must be at least 1, got --dp {dp}")
    architecture, family = archs.target_family(target.config)
    num_layers = config_int(target.config, "num_hidden_layers")
    problems: list[str] = []
    topology: Topology | None = None
    try:
        topology = make_topology(num_layers, tp, pp, partition, partition_origin)
    except PlanError as exc:
        problems.append(str(exc))
    if stage is not None and not 0 <= stage < pp:
        problems.append(f"--stage {stage} is outside the pipeline stages 0..{pp - 1}")
    stages = tuple(range(pp)) if stage is None else (stage,)
    model_dtype = resolve_dtype(dtype, target.config, target)

    problems += dp_problems(dp, expert_parallel)
    if mxfp4_pad is not None and not isinstance(scheme_of(target.config), Mxfp4Quant):
        problems.append(
            f"--mxfp4-pad {mxfp4_pad} matters only to MXFP4 checkpoints (quant_method mxfp4); "
            "leave it out"
        )
    moe = {"expert_parallel": expert_parallel, "dp": dp, "mxfp4_pad": mxfp4_pad}
    draft_kind = None
    if draft is not None:
        draft_kind = draft_method or archs.detect_draft_method(
            draft.config, sorted(draft.tensors), family.name
        )
    target_context = {"with_draft": draft is not None, "draft_method": draft_kind, "pp": pp, **moe}
    jobs: list[tuple[str, str, str | None, Family, SourceModel, dict[str, Any]]] = [
        ("target", architecture, None, family, target, target_context)
    ]
    if draft is not None and draft_kind is not None:
        context = {
            "target_config": target.config,
            "draft_names": sorted(draft.tensors),
            "distinct_copies": distinct_copies,
            **moe,
        }
        jobs.append(
            (
                "draft",
                draft_kind,
                draft_kind,
                archs.draft_family(draft_kind, family.name),
                draft,
                context,
            )
        )
    layouts = []
    for role, arch_name, method, fam, source, context in jobs:
        layout, found = checked_layout(role, fam, source, tp, topology, context)
        problems += found
        layouts.append((role, arch_name, method, fam, source, layout))
    if expert_parallel and not any(layout and layout.num_experts for *_, layout in layouts):
        problems.append(
            f"--enable-expert-parallel needs a mixture-of-experts model; {architecture} has "
            "no experts, so leave the flag out"
        )
    if dp > 1 and not any(layout and layout.num_experts for *_, layout in layouts):
        problems.append(
            f"--dp {dp} matters only to a mixture-of-experts model; {architecture} has no "
            "experts and is the same on every data-parallel rank, so leave --dp out"
        )
    if problems or topology is None:
        raise PlanError(problem_summary(problems))
    models: list[ModelPlan] = []
    files: list[FilePlan] = []
    for role, arch_name, method, fam, source, layout in layouts:
        assert layout is not None
        scheme = scheme_of(source.config, mxfp4_pad)
        scheme = fam.quant_scheme(scheme) if scheme is not None else None
        folder = "" if role == "target" else DRAFT_DIR
        models.append(
            ModelPlan(
                role=role,
                architecture=arch_name,
                method=method,
                dtype=model_dtype,
                folder=folder,
                num_layers=int(source.config.get("num_hidden_layers", 0)),
                spec_decode_only=tuple(sorted(layout.spec_decode_only)),
                shared_with_target=tuple(sorted(layout.shared_with_target)),
                skipped=tuple(sorted(layout.skipped.items())),
                experts=_expert_plan(layout, tp, dp, expert_parallel, expert_placement, scheme),
                family=fam.name,
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
        )
        # A draft lives on the last stage only.
        model_stages = stages if role == "target" else tuple(s for s in stages if s == pp - 1)
        files += _rank_files(models[-1], layout, source, model_stages, tp, max_part_bytes)
    return Plan(topology, stages, tuple(models), tuple(files))


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
        shape: tuple[int, ...] = (len(blocks),)
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
