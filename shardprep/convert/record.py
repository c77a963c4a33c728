"""The manifest of a conversion, built from its plan and what the executor wrote."""

from __future__ import annotations

import shardprep
from shardprep.constants import FORMAT
from shardprep.convert.checkpoint import Checkpoint, known_sha256
from shardprep.format import manifest as mf
from shardprep.format.headers import encode_header
from shardprep.format.vllm_layout import MOE_ASSUMPTIONS, current_layout, derived_layout
from shardprep.plan.cuts import Piece
from shardprep.plan.derived import DERIVED, installed_vllm
from shardprep.plan.records import FilePlan, ModelPlan, Plan


def manifest_of(
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    sources: dict[str, str],
    done: dict[str, str],
    source_hashes: dict[tuple[str, str], str],
    extra: list[mf.ExtraFile],
) -> mf.Manifest:
    """The manifest of a finished conversion: what each rank file holds, where every
    piece came from, and the source files with their sha256."""
    models = []
    for model in plan.models:
        checkpoint = checkpoints[model.role]
        ranks: dict[str, dict[str, mf.ParamSpec]] = {}
        for file in plan.files:
            if file.role == model.role:
                specs = ranks.setdefault(mf.rank_key(file.pp, file.tp, file.dp), {})
                specs.update({t.name: mf.ParamSpec(t.dtype, t.shape) for t in file.tensors})
        source = mf.Source(
            model=sources[model.role],
            repo_id=checkpoint.repo_id,
            revision=checkpoint.revision,
            files=tuple(
                mf.SourceFile(
                    f,
                    checkpoint.size(f),
                    source_hashes.get((model.role, f)) or _known_sha256(checkpoint, f),
                )
                for f in checkpoint.files
            ),
        )
        models.append(
            mf.ModelEntry(
                role=model.role,
                architecture=model.architecture,
                dtype=model.dtype,
                folder=model.folder,
                num_layers=model.num_layers,
                source=source,
                method=model.method,
                ranks=ranks,
                spec_decode_only=model.spec_decode_only,
                shared_with_target=model.shared_with_target,
                experts=_experts(model),
                quantization=model.quantization,
                pieces={name: tuple(map(_piece_entry, ps)) for name, ps in model.pieces},
                source_shapes=dict(model.source_shapes),
            )
        )
    files = tuple(
        mf.FileEntry(f.path, f.role, f.pp, f.tp, f.part, _size(f), done[f.path], dp=f.dp)
        for f in plan.files
    )
    topology = mf.Topology(
        plan.topology.tp,
        plan.topology.pp,
        plan.topology.partition,
        expert_parallel=any(m.experts and m.experts.split.expert_parallel for m in plan.models),
    )
    layout = current_layout(
        {m.family for m in plan.models} | {m.scheme for m in plan.models if m.scheme}
    )
    if DERIVED in layout.revisions:  # derived from the vLLM installed here, and only it
        layout = derived_layout(layout, installed_vllm())
    return mf.Manifest(
        format=FORMAT,
        shardprep_version=shardprep.__version__,
        vllm_layout=layout,
        topology=topology,
        stages=plan.stages,
        models=tuple(models),
        files=files,
        extra_files=tuple(sorted(extra, key=lambda e: e.path)),
    )


def _piece_entry(piece: Piece) -> mf.PieceEntry:
    of = piece.scale_of
    scale = (
        None if of is None else mf.ScaleEntry(of.shape, of.cut.value, of.block, of.grid, of.heads)
    )
    return mf.PieceEntry(
        piece.source, piece.cut.value, piece.heads, piece.expert, scale, piece.q_heads
    )


def _known_sha256(checkpoint: Checkpoint, file: str) -> str | None:
    known = known_sha256(checkpoint, file)
    return known.sha256 if known else None


def _experts(model: ModelPlan) -> mf.Experts | None:
    if model.experts is None:
        return None
    split = model.experts.split
    return mf.Experts(
        num_experts=split.num_experts,
        expert_parallel=split.uses_ep,
        dp=split.dp,
        placement=split.placement,
        requested_placement=model.experts.requested_placement,
        rank_experts=model.experts.rank_experts,
        assumptions=dict(MOE_ASSUMPTIONS) | dict(model.experts.assumptions),
    )


def _size(file: FilePlan) -> int:
    return len(encode_header([t.spec for t in file.tensors], {"format": "pt"})) + file.nbytes
