"""Loading an artifact at another topology: tp' dividing the artifact's tp, any pp'.

Each rank computes its own plan for tp' x pp' from the pieces and source shapes the
manifest records (the same plan code as `convert`), finds every block it needs in the
artifact's rank tensors (`shardprep.plan.regions`), and reads those rows with plain
positioned reads: no collective, each byte at most once, only the files of the artifact
ranks that hold a tensor of this rank (so only the stages of its layers). Parameters that
vLLM did not build on this rank are never read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardprep.errors import PlanError, TopologyMismatchError
from shardprep.format.headers import TensorInfo
from shardprep.format.manifest import (
    Manifest,
    ModelEntry,
    ParamSpec,
    read_regions,
    split_rank_key,
)
from shardprep.loader.cpu_read import torch_dtypes
from shardprep.loader.experts import check_device_layout
from shardprep.loader.fill import StackPads, fill_parameters, no_stack_pads
from shardprep.loader.reader import RankFile, check_rank_files

logger = logging.getLogger("shardprep.loader")

if TYPE_CHECKING:
    from shardprep.loader.checks import RankPlace
    from shardprep.plan.archs.base import DraftFamily
    from shardprep.plan.topology import ExpertSplit


def check_served(artifact: Path, manifest: Manifest, tp: int, pp: int) -> None:
    """Refuse, in one line, a topology this artifact cannot be cut into."""
    topo = manifest.topology
    if tp in manifest.served_tps:
        return
    why = "the artifact cannot be cut into other topologies"
    if manifest.served_tps:
        why = f"tp{tp} is not a divisor of the artifact's tp{topo.tp}"
    if manifest.served_tps and topo.tp % tp == 0:
        why = (
            f"vLLM splits its MXFP4 experts' 32-blocks at tp{tp} across the artifact's "
            f"tp{topo.tp} ranks"
        )
    raise TopologyMismatchError(
        f"artifact {artifact} is tp{topo.tp} x pp{topo.pp} and serves "
        f"{manifest.served_topologies()}; vLLM runs tp{tp} x pp{pp}, which it cannot serve "
        f"({why}); start vLLM at a topology it serves, or convert again with "
        f"--tp {tp} --pp {pp}"
    )


def load_regrouped(
    artifact: Path,
    manifest: Manifest,
    entry: ModelEntry,
    model: torch.nn.Module,
    place: RankPlace,
    partition: tuple[int, ...],
    *,
    verify: bool,
    family: DraftFamily | None,
    may_lack: set[str],
    padded: Callable[[str], bool] = lambda name: False,
    stacks: StackPads = no_stack_pads,
) -> None:
    """Fill the model from an artifact of another topology (vLLM's layer `partition`):
    the draft family's hooks around the copy, as at the artifact's own topology."""
    from shardprep.plan.many import no_cycle_collection
    from shardprep.plan.regions import worker_stages

    wanted = _wanted(model, entry)
    try:
        stages = worker_stages(
            manifest.topology, partition, place.pp_rank, draft=entry.role == "draft"
        )
    except PlanError as exc:
        raise TopologyMismatchError(
            f"artifact {artifact} cannot serve vLLM's pipeline split: {exc}"
        ) from None
    where = (
        f"{artifact} ({entry.role}, rank pp{place.pp_rank} tp{place.tp_rank} of "
        f"tp{place.tp_size} x pp{place.pp_size})"
    )
    if family is not None:
        family.before_fill(model, set(wanted))
    count = ReadCount()
    tensors = regroup_rank(
        artifact, manifest, entry, wanted, tp=place.tp_size, tp_rank=place.tp_rank,
        experts=running_split(model, entry, place), verify=verify, count=count, stages=stages,
    )  # fmt: skip
    if entry.experts is not None:
        tensors = _device_layout_checked(artifact, entry, model, tensors, stacks)
    with no_cycle_collection():  # the regions and the regroup plan are made as it fills
        filled = fill_parameters(
            model, tensors, ignorable=set(), may_lack=may_lack, where=where,
            layout=manifest.vllm_layout.id, padded=padded, stacks=stacks,
        )  # fmt: skip
    if family is not None:
        family.after_fill(model, set(filled))
    ratio = count.read / count.own if count.own else 1.0
    logger.info(
        "shardprep cut %d tensors of %s out of tp%d x pp%d files: read %d bytes for %d of "
        "its own (%.2f), from %d file(s)",
        len(filled), where, manifest.topology.tp, manifest.topology.pp, count.read,
        count.own, ratio, len(count.files),
    )  # fmt: skip


def _device_layout_checked(
    artifact: Path,
    entry: ModelEntry,
    model: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    stacks: StackPads,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The expert stacks cut for this rank have the shapes vLLM built, or fit where the
    MoE backend pads them (as `check_moe` checks the files of an artifact's own topology)."""
    assert entry.experts is not None
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, tensor in tensors:
        spec = ParamSpec(entry.dtype, tuple(tensor.shape))
        check_device_layout(artifact, entry.experts, {name: spec}, built, stacks)
        yield name, tensor


def _wanted(model: torch.nn.Module, entry: ModelEntry) -> list[str]:
    """Per parameter or buffer of the model (tied aliases once), the name the artifact
    records it under."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    return [
        next((n for n in aliases if n in entry.pieces), aliases[0]) for aliases in names.values()
    ]


@dataclass
class ReadCount:
    """Bytes this rank read, and the bytes of the tensors it filled less their zero
    padding, which is made, not read (1.00 is the goal); the files it opened."""

    read: int = 0
    own: int = 0
    files: set[str] = field(default_factory=set)


def regroup_rank(
    artifact: Path,
    manifest: Manifest,
    entry: ModelEntry,
    wanted: list[str],
    *,
    tp: int,
    tp_rank: int,
    experts: tuple[ExpertSplit, int] | None = None,
    verify: bool = False,
    count: ReadCount | None = None,
    stages: Collection[int] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for each parameter `plan_regroup` makes, read from the
    artifact's rank files with positioned reads; the pieces from the regions file."""
    from shardprep.plan.regroup import plan_regroup  # pure, but only another topology's

    manifest = read_regions(artifact, manifest)
    entry = manifest.model(entry.role) or entry
    count = count if count is not None else ReadCount()
    files: dict[str, list[RankFile]] = {}
    fds: dict[Path, int] = {}
    dtypes = torch_dtypes(torch)
    planned = plan_regroup(
        artifact, manifest, entry, wanted, tp=tp, tp_rank=tp_rank, experts=experts,
        stages=stages,
    )  # fmt: skip
    try:
        for made in planned:
            name, mine = made.name, made.tensor
            out = torch.empty(mine.stacked_shape, dtype=dtypes[mine.dtype])
            flat = out.view(out.shape[0] if out.dim() else 1, -1)
            for start, end in made.zeros:
                flat[start:end].zero_()
            for read in made.reads:
                rank_file, info = _find(
                    artifact, manifest, entry, files, read.holder, read.tensor, verify
                )
                fd = fds.get(rank_file.path)
                if fd is None:
                    fd = fds[rank_file.path] = os.open(rank_file.path, os.O_RDONLY)
                    count.files.add(str(rank_file.path))
                rows, row_bytes = read.rows[1] - read.rows[0], info.nbytes // read.height
                span = (info.offset + read.rows[0] * row_bytes, rows * row_bytes)
                dest = flat[read.dest_rows[0] : read.dest_rows[1]]
                if read.dest_cols is None:
                    _pread_into(fd, dest, *span)
                else:
                    part = torch.empty((rows, row_bytes // out.element_size()), dtype=out.dtype)
                    _pread_into(fd, part, *span)
                    dest[:, read.dest_cols[0] : read.dest_cols[1]] = part
                count.read += span[1]
            padding = sum(end - start for start, end in made.zeros) * flat[:1].nbytes
            count.own += out.numel() * out.element_size() - padding
            yield name, out.view(mine.shape)
    finally:
        for fd in fds.values():
            os.close(fd)


def _find(
    artifact: Path,
    manifest: Manifest,
    entry: ModelEntry,
    files: dict[str, list[RankFile]],
    holder: str,
    tensor: str,
    verify: bool,
) -> tuple[RankFile, TensorInfo]:
    """The file of artifact rank `holder` that holds `tensor`, its files checked once."""
    rank_files = files.get(holder)
    if rank_files is None:
        pp, tp, dp = split_rank_key(holder)
        rank_files = files[holder] = check_rank_files(
            artifact, manifest, entry.role, pp, tp, verify=verify, dp_rank=dp or 0
        )
    for rank_file in rank_files:
        info = rank_file.header.tensors.get(tensor)
        if info is not None:
            return rank_file, info
    raise TopologyMismatchError(f"{artifact}: rank {holder} has no tensor {tensor}")


def _pread_into(fd: int, dest: torch.Tensor, offset: int, length: int) -> None:
    if not dest.is_contiguous() or dest.numel() * dest.element_size() != length:
        raise AssertionError("the destination rows are not one contiguous span")
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at byte {offset + done} of a rank file")
        done += got


def running_split(
    model: torch.nn.Module, entry: ModelEntry, place: RankPlace
) -> tuple[ExpertSplit, int] | None:
    """How vLLM spreads the experts on this rank, as the plan's ExpertSplit and MoE rank."""
    if entry.experts is None:
        return None
    from shardprep.loader.experts import RunningExperts, check_expert_parallel
    from shardprep.plan.topology import ExpertSplit

    running = RunningExperts.current(model, place.tp_rank)
    if running is None:
        return None
    check_expert_parallel(entry, running)
    split = ExpertSplit(
        entry.experts.num_experts, place.tp_size, running.dp, running.expert_parallel,
        running.placement,
    )  # fmt: skip
    moe_rank = split.moe_rank(place.tp_rank, place.dp_rank)
    if running.held is not None and running.held != split.experts(moe_rank):
        raise TopologyMismatchError(
            f"vLLM holds experts {list(running.held)[:8]} on this rank, not the "
            f"{list(split.experts(moe_rank))[:8]} shardprep derives for it; load this artifact "
            "at its own topology"
        )
    return split, moe_rank
