"""Runs in the deriving child, beside probe.py: vLLM's engine config of a request and
vLLM's model of one rank built on the meta device inside one process: its tensor-,
pipeline- and expert-parallel ranks set to the rank's coordinates without any peer, the
parameters kept on the meta device where vLLM would move them, and its expert maps built
as on a real rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
from torch.nn import Parameter

from shardprep.plan.derived import draft_probe


def engine_config(request: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=request["folder"],
        tensor_parallel_size=request["tp"],
        pipeline_parallel_size=request["pp"],
        dtype=request["dtype"],
        load_format="safetensors",
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_expert_parallel=request.get("expert_placement") is not None,
        expert_placement_strategy=request.get("expert_placement") or "linear",
        enable_prefix_caching=False,  # nothing is cached; some models refuse it (Kimi-K3)
        speculative_config=draft_probe.speculative(request),
    )
    with draft_probe.building(request):
        return args.create_engine_config()


@contextmanager
def no_peers() -> Iterator[None]:
    """vLLM's groups, built over torch's fake process group, without the parts that
    would talk to other processes (gloo CPU groups, device communicators, shared-memory
    queues, the host-name gather)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    real_new_group = dist.new_group
    real_init = parallel_state.GroupCoordinator.__init__

    def new_group(ranks: Any = None, backend: Any = None, **kwargs: Any) -> Any:
        return real_new_group(ranks, backend="fake", **kwargs)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.update(use_device_communicator=False, use_message_queue_broadcaster=False)
        real_init(self, *args, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "new_group", new_group))
        stack.enter_context(mock.patch.object(parallel_state, "_node_count", lambda *a: 1))
        stack.enter_context(mock.patch.object(parallel_state.GroupCoordinator, "__init__", init))
        yield


def set_rank(config: Any, tp: int, pp: int, p: int, t: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from vllm.distributed import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    rank = p * tp + t
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp)
    parallel_state.init_distributed_environment(tp * pp, rank, "env://", 0, "fake")
    parallel_state.initialize_model_parallel(tp, pp, backend="fake")


def on_meta(model: torch.nn.Module) -> dict[str, Any]:
    """The model's parameters, those a layer builds on a device of its own choosing
    (Qwen3-Next's gated norm, DeepSeek-V4's compressor positions) replaced by meta ones
    like the rest: a placeholder is copied into none but a meta tensor. Integer tensors
    (expert maps) stay real."""
    for name, param in list(model.named_parameters()):
        if param.is_meta or not param.is_floating_point() or type(param) is not Parameter:
            continue
        owner, _, attr = name.rpartition(".")
        meta = Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        meta.__dict__.update(param.__dict__)  # its weight_loader and other attributes
        setattr(model.get_submodule(owner), attr, meta)
    return dict(model.named_parameters())


@contextmanager
def kept_on_meta() -> Iterator[None]:
    """A module built on meta stays there when a model moves it to its device while it
    is built (Kimi-K2.5's vision tower); a cast to a dtype still applies."""
    real_to = torch.nn.Module.to

    def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not any(param.is_meta for param in module.parameters()):
            return real_to(module, *args, **kwargs)
        dtype = torch._C._nn._parse_to(*args, **kwargs)[1]
        return module if dtype is None else real_to(module, dtype=dtype)

    with mock.patch.object(torch.nn.Module, "to", to):
        yield


@contextmanager
def real_expert_maps() -> Iterator[None]:
    """vLLM's map of global to local experts (expert parallelism) built on the CPU, not on
    meta: its loader reads it to skip the experts of other ranks."""
    from vllm.model_executor.layers.fused_moe import expert_map_manager

    manager = expert_map_manager.ExpertMapManager
    real_init = manager.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with torch.device("cpu"):
            real_init(self, *args, **kwargs)

    with mock.patch.object(manager, "__init__", init):
        yield


def as_cpu_worker() -> None:
    """What vLLM's CPU worker sets up before it builds a model (stand-ins for CUDA events
    and streams that some layers create while they are built); nothing elsewhere."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.v1.worker.cpu.shm  # noqa: F401 (its import is the set-up)
