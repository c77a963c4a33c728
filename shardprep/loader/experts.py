"""Checks of a mixture-of-experts artifact against how vLLM was started.

The manifest records how the experts are spread (expert parallelism, data parallel size,
placement, the experts of every EP rank) and the device-dependent layout it assumes.
vLLM's side is read once from its config and its FusedMoE layers (`expert_map_manager`);
the comparisons are pure functions, so each message is tested as users see it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from shardprep.errors import TopologyMismatchError
from shardprep.format.cut_names import MXFP4_PADDING_AT_LOAD
from shardprep.format.manifest import Experts, ModelEntry, ParamSpec
from shardprep.loader.fill import StackPads, no_stack_pads


@dataclass(frozen=True)
class RunningExperts:
    """How the running vLLM spreads the experts, on this rank."""

    expert_parallel: bool  # vLLM uses EP (the flag is on and tp x dp > 1)
    flag: bool  # --enable-expert-parallel as given
    dp: int
    placement: str
    ep_rank: int
    held: tuple[int, ...] | None  # global experts of this rank, local order; None: all

    @classmethod
    def current(cls, model: nn.Module, tp_rank: int) -> RunningExperts | None:
        """Read from vLLM; None when the model built no FusedMoE layer."""
        from vllm.config import get_current_vllm_config

        # vLLM's FusedMoE layers carry it; an attribute of a module, read by name.
        managers = (getattr(m, "expert_map_manager", None) for m in model.modules())
        manager = next((m for m in managers if m is not None), None)
        if manager is None:
            return None
        parallel = get_current_vllm_config().parallel_config
        held = None
        if manager.expert_map is not None:
            expert_map = manager.expert_map.tolist()
            local = {g: loc for g, loc in enumerate(expert_map) if loc >= 0}
            held = tuple(sorted(local, key=local.__getitem__))
        return cls(
            expert_parallel=bool(manager.use_ep),
            flag=bool(parallel.enable_expert_parallel),
            dp=int(parallel.data_parallel_size),
            placement=str(manager.placement_strategy),
            ep_rank=int(manager.ep_rank) if manager.use_ep else tp_rank,
            held=held,
        )


def check_expert_parallel(entry: ModelEntry, running: RunningExperts) -> None:
    """vLLM runs the experts with expert parallelism only for a family whose experts
    shardprep lays out that way (`Family.expert_parallel_refusal`)."""
    if entry.role != "target" or not running.expert_parallel:
        return  # a draft is loaded after its target, which this checks
    from shardprep.plan import archs  # pure data

    refusal = archs.target_family_of(entry.architecture).expert_parallel_refusal
    if refusal:
        raise TopologyMismatchError(
            f"vLLM runs {entry.architecture} with --enable-expert-parallel, but {refusal}; "
            "start vLLM without --enable-expert-parallel"
        )


def check_experts(
    artifact: Path, experts: Experts, running: RunningExperts, convert_hint: str
) -> None:
    """The artifact's expert layout is the one vLLM built on this rank; else one line
    naming both sides and the flag to change. `convert_hint` is the shardprep command
    to make a matching artifact, with EP_FLAGS where the expert flags go."""
    ours = "on" if experts.expert_parallel else "off"
    theirs = "on" if running.expert_parallel else "off"
    if experts.expert_parallel != running.expert_parallel:
        flag = "--enable-expert-parallel"
        start = f"with {flag}" if experts.expert_parallel else f"without {flag}"
        redo = convert_hint.replace(
            "EP_FLAGS", _ep_flags(running) if running.expert_parallel else ""
        )
        raise TopologyMismatchError(
            f"artifact {artifact} holds experts with expert parallelism {ours} but vLLM runs "
            f"with it {theirs} ({flag} {'given' if running.flag else 'not given'}); start vLLM "
            f"{start}, or re-run `{redo}`"
        )
    if experts.dp != running.dp:
        redo = convert_hint.replace("EP_FLAGS", _ep_flags(running))
        also = f", or re-run `{redo}`" if running.expert_parallel else ""
        raise TopologyMismatchError(
            f"artifact {artifact} holds experts for --data-parallel-size {experts.dp} but vLLM "
            f"runs --data-parallel-size {running.dp}, which changes which experts each rank "
            f"holds; start vLLM with --data-parallel-size {experts.dp}{also}"
        )
    if experts.expert_parallel and experts.placement != running.placement:
        raise TopologyMismatchError(
            f"artifact {artifact} places experts {experts.placement} but vLLM places them "
            f"{running.placement}; start vLLM with --expert-placement-strategy "
            f"{experts.placement}, or re-run `shardprep convert` with "
            f"--expert-placement-strategy {running.placement}"
        )
    expected = experts.rank_experts[running.ep_rank] if experts.expert_parallel else None
    if running.held is not None and tuple(running.held) != expected:
        raise TopologyMismatchError(
            f"vLLM holds experts {_short(running.held)} on EP rank {running.ep_rank} but "
            f"artifact {artifact} holds {_short(expected or ())} there; start vLLM without "
            "--enable-eplb and without redundant experts, as the artifact assumes"
        )


def check_device_layout(
    artifact: Path,
    experts: Experts,
    files: Mapping[str, ParamSpec],
    built: Mapping[str, tuple[int, ...]],
    stacks: StackPads = no_stack_pads,
) -> None:
    """The expert stacks vLLM built have the shapes of the files, or hold them where the
    MoE backend pads them (`stacks`: MXFP4). Some backends build another layout before
    processing (the manifest's `assumptions`); name the setting."""
    for name, spec in sorted(files.items()):
        shape = built.get(name)
        if len(spec.shape) != 3 or shape is None or tuple(shape) == tuple(spec.shape):
            continue
        if stacks(name, tuple(spec.shape), tuple(shape)) is not None:
            continue
        where = (
            f"vLLM built {name} as {list(shape)} but artifact {artifact} holds {list(spec.shape)}"
        )
        if shape[0] != spec.shape[0]:
            assumed = experts.assumptions.get("fused_shared_experts", "none")
            raise TopologyMismatchError(
                f"{where}: more experts per rank than routed ones, as when ROCm AITER fuses "
                f"the shared experts in (the artifact assumes fused_shared_experts={assumed}); "
                "start vLLM with VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0"
            )
        mxfp4 = experts.assumptions.get("mxfp4_padding")
        if mxfp4 is not None and mxfp4 != MXFP4_PADDING_AT_LOAD:
            raise TopologyMismatchError(
                f"{where}: vLLM's MXFP4 MoE backend pads the experts less than the artifact, "
                f"converted with --mxfp4-pad {mxfp4}; re-run `shardprep convert` without "
                "--mxfp4-pad, which stores the experts unpadded for every backend"
            )
        if mxfp4 is not None:
            raise TopologyMismatchError(
                f"{where}: the MoE backend built expert stacks smaller than the rank's MXFP4 "
                "blocks, which vLLM's own loader cannot fill either; start vLLM with another "
                "--moe-backend"
            )
        assumed = experts.assumptions.get("moe_intermediate_padding", "none")
        raise TopologyMismatchError(
            f"{where}: this MoE backend pads the experts' intermediate size (FlashInfer "
            f"TRT-LLM, ROCm AITER; the artifact assumes moe_intermediate_padding={assumed}); "
            "start vLLM with --moe-backend triton (on ROCm: VLLM_ROCM_USE_AITER_MOE=0)"
        )


def _ep_flags(running: RunningExperts) -> str:
    """The convert flags that match how vLLM runs the experts."""
    flags = "--enable-expert-parallel " if running.flag else ""
    return flags + (f"--dp {running.dp} " if running.dp > 1 else "")


def _short(ids: tuple[int, ...] | list[int]) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= 8 else f"[{ids[0]}, {ids[1]}, ... {ids[-1]}] ({len(ids)})"
