"""Collectives made to fail for the span of one load (the rank-local promise, checked
inside a real vLLM worker): torch.distributed's functions and process-group methods,
and vLLM's own group coordinator, whose CPU communicators bypass torch.distributed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

TORCH_FUNCTIONS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list",
    "recv_object_list", "batch_isend_irecv",
)  # fmt: skip
PROCESS_GROUP_METHODS = (
    "allreduce", "allgather", "_allgather_base", "alltoall", "alltoall_base", "barrier",
    "broadcast", "gather", "scatter", "reduce", "reduce_scatter", "_reduce_scatter_base",
    "send", "recv", "recv_anysource",
)  # fmt: skip
COORDINATOR_METHODS = (
    "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
    "broadcast", "broadcast_object", "broadcast_object_list", "send_object", "recv_object",
    "isend_object", "broadcast_tensor_dict", "send_tensor_dict", "isend_tensor_dict",
    "recv_tensor_dict", "irecv_tensor_dict", "barrier", "send", "recv",
)  # fmt: skip


class RefusedCalls(list):
    """Names of the collectives called (and refused); `patched` counts those patched."""

    patched: int = 0


@contextlib.contextmanager
def collectives_refused() -> Iterator[RefusedCalls]:
    """Within the block every collective records its name and raises; the list of names
    is yielded. On entry, one tensor-parallel barrier proves the patch is in force."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from vllm.distributed import parallel_state

    calls = RefusedCalls()
    saved: list[tuple[object, str, object]] = []

    def refusing(name: str) -> Callable[..., None]:
        def refuse(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise RuntimeError(f"{name} was called during a rank-local load")

        return refuse

    targets = [(dist, TORCH_FUNCTIONS), (c10d, TORCH_FUNCTIONS)]
    targets += [(dist.ProcessGroup, PROCESS_GROUP_METHODS)]
    targets += [(parallel_state.GroupCoordinator, COORDINATOR_METHODS)]
    for owner, names in targets:
        for name in names:
            if hasattr(owner, name):
                # The raw entry (a pybind11 method's descriptor, which getattr would
                # unwrap into a function that no longer binds `self`), or None when the
                # name is inherited and restoring means removing the patch.
                saved.append((owner, name, vars(owner).get(name)))
                setattr(owner, name, refusing(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        with contextlib.suppress(RuntimeError):
            parallel_state.get_tp_group().barrier()
        if calls != ["GroupCoordinator.barrier"]:
            raise AssertionError(f"the collective trap is not in force: {calls}")
        calls.clear()
        calls.patched = len(saved)
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
