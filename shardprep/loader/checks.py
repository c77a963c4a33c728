"""What the loader checks before it reads a byte: the artifact was made for the dtype,
topology, layer partition and expert settings vLLM runs with. Each mismatch is one line
naming both sides and what to change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from vllm.config import ModelConfig

from shardprep.errors import TopologyMismatchError
from shardprep.format.dtypes import TORCH_DTYPE_NAMES
from shardprep.format.manifest import Manifest, ModelEntry
from shardprep.loader.experts import (
    RunningExperts,
    check_device_layout,
    check_expert_parallel,
    check_experts,
)
from shardprep.loader.fill import stack_pads


@dataclass(frozen=True)
class RankPlace:
    """Where this worker sits: its ranks in vLLM's pipeline, tensor and data parallel
    groups (the dp rank picks its experts where they are stored per dp rank)."""

    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    dp_size: int = 1

    @classmethod
    def current(cls) -> RankPlace:
        from vllm.distributed import (
            get_dp_group,
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp, dp = get_pp_group(), get_dp_group()  # FusedMoE reads its dp rank the same way
        return cls(
            pp_rank=pp.rank_in_group,
            pp_size=pp.world_size,
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            dp_rank=dp.rank_in_group if dp.world_size > 1 else 0,
            dp_size=dp.world_size,
        )

    @property
    def processes(self) -> int:
        """The worker processes that load the model at once (every data-parallel copy's)."""
        return self.tp_size * self.pp_size * self.dp_size


def check_dtype(artifact: Path, entry: ModelEntry, running: torch.dtype | str) -> None:
    """The weights' dtype is fixed at conversion; vLLM's must be the same (`running`: its
    model config's dtype, a torch dtype once vLLM has resolved it, as at load)."""
    stored = TORCH_DTYPE_NAMES.get(entry.dtype, entry.dtype)
    if str(running).removeprefix("torch.") == stored:
        return
    raise TopologyMismatchError(
        f"artifact {artifact} holds {stored} weights but vLLM runs {running}; start vLLM "
        f"with --dtype {stored}, or convert again with `shardprep convert --dtype "
        f"{str(running).removeprefix('torch.')}`"
    )


def check_topology(artifact: Path, manifest: Manifest, place: RankPlace) -> None:
    topo = manifest.topology
    if (topo.tp, topo.pp) == (place.tp_size, place.pp_size):
        return
    source = source_of(manifest)
    raise TopologyMismatchError(
        f"artifact {artifact} is tp{topo.tp} x pp{topo.pp} but vLLM runs "
        f"tp{place.tp_size} x pp{place.pp_size}; re-run `shardprep convert {source} "
        f"--tp {place.tp_size} --pp {place.pp_size} -o NEW` or start vLLM with "
        f"--tensor-parallel-size {topo.tp} --pipeline-parallel-size {topo.pp}"
    )


def vllm_layers(
    model: nn.Module, model_config: ModelConfig, place: RankPlace
) -> tuple[tuple[int, int], tuple[int, ...]]:
    """The layer range vLLM built on this stage (from the model when it says so), and
    vLLM's whole partition (from `get_pp_indices`, which reads VLLM_PP_LAYER_PARTITION)."""
    from vllm.distributed.utils import get_pp_indices

    total = model_config.get_total_num_hidden_layers()
    ranges = [get_pp_indices(total, stage, place.pp_size) for stage in range(place.pp_size)]
    partition = tuple(end - start for start, end in ranges)
    for module in (getattr(model, "model", None), model):
        start, end = getattr(module, "start_layer", None), getattr(module, "end_layer", None)
        if isinstance(start, int) and isinstance(end, int):
            return (start, end), partition
    return ranges[place.pp_rank], partition


def check_layers(
    artifact: Path,
    manifest: Manifest,
    place: RankPlace,
    built: tuple[int, int],
    vllm_partition: tuple[int, ...],
) -> None:
    partition = manifest.topology.partition
    start = sum(partition[: place.pp_rank])
    expected = (start, start + partition[place.pp_rank])
    if built == expected:
        return
    ours, theirs = ",".join(map(str, partition)), ",".join(map(str, vllm_partition))
    raise TopologyMismatchError(
        f"artifact {artifact} puts layers {expected[0]}-{expected[1] - 1} on stage "
        f"{place.pp_rank} (partition {ours}) but vLLM built layers {built[0]}-{built[1] - 1} "
        f"there (partition {theirs}); start vLLM with VLLM_PP_LAYER_PARTITION={ours}, or "
        f"convert again with VLLM_PP_LAYER_PARTITION={theirs} set"
    )


def check_moe(
    artifact: Path, manifest: Manifest, entry: ModelEntry, model: nn.Module, place: RankPlace
) -> None:
    """Expert parallelism, placement and the device-dependent expert layout."""
    if entry.experts is None:
        return
    running = RunningExperts.current(model, place.tp_rank)
    if running is None:
        return
    check_expert_parallel(entry, running)
    hint = f"shardprep convert {source_of(manifest)} --tp {place.tp_size} --pp {place.pp_size} "
    check_experts(artifact, entry.experts, running, hint + "EP_FLAGS-o NEW")
    files = entry.rank_params(place.pp_rank, place.tp_rank, place.dp_rank)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_device_layout(artifact, entry.experts, files, built, stack_pads(entry.quantization))


def source_of(manifest: Manifest) -> str:
    target = manifest.model("target")
    return target.source.model if target is not None and target.source.model else "MODEL"
