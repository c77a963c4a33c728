"""Every collective refused while a load runs: torch.distributed (module functions,
process-group methods, functional collectives) and vLLM's group coordinators."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

TRAP_ENV = "SHARDPREP_TRAP_COLLECTIVES"
TORCH_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list",
    "recv_object_list", "batch_isend_irecv", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip
PROCESS_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "alltoall", "alltoall_base", "barrier", "broadcast", "gather", "scatter", "reduce",
    "reduce_scatter", "_reduce_scatter_base", "send", "recv", "recv_anysource",
)  # fmt: skip
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
)  # fmt: skip
COORDINATOR_METHODS = (
    "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
    "broadcast", "broadcast_object", "broadcast_object_list", "broadcast_tensor_dict",
    "send_object", "recv_object", "send_tensor_dict", "recv_tensor_dict", "barrier", "send",
    "recv",
)  # fmt: skip


@contextlib.contextmanager
def collectives_trapped() -> Iterator[list[str]]:
    """Within the block every collective records its name and raises; the patch is
    checked first (a barrier must be refused), and undone afterwards."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional
    import torch.distributed.distributed_c10d as c10d
    from vllm.distributed.parallel_state import GroupCoordinator

    calls: list[str] = []
    saved: list[tuple[Any, str, Any]] = []

    def refusing(name: str) -> Callable[..., None]:
        def refuse(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise RuntimeError(f"{name} was called during a rank-local load")

        return refuse

    targets = [(dist, TORCH_COLLECTIVES, "torch.distributed."), (c10d, TORCH_COLLECTIVES, "c10d.")]
    targets += [(dist.ProcessGroup, PROCESS_GROUP_METHODS, "ProcessGroup.")]
    targets += [(functional, FUNCTIONAL_COLLECTIVES, "functional.")]
    targets += [(GroupCoordinator, COORDINATOR_METHODS, "GroupCoordinator.")]
    for owner, names, label in targets:
        for name in names:
            if hasattr(owner, name):
                saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name))))
                setattr(owner, name, refusing(label + name))
    try:
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        if calls != ["torch.distributed.barrier"]:
            raise AssertionError(f"a barrier went through the collective trap: {calls}")
        calls.clear()
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
