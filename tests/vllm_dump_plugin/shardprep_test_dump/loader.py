"""``DumpDefaultLoader``: vLLM's default loader plus a dump of the loaded parameters."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from torch import nn
from vllm.config import ModelConfig, get_current_vllm_config_or_none
from vllm.config.load import LoadConfig
from vllm.config.utils import replace
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from shardprep_test_dump import DUMP_DIR_ENV
from shardprep_test_dump.state import save_state


def model_role(model_config: ModelConfig) -> str:
    """``target`` or ``draft``, told apart by object identity with the worker's config."""
    current = get_current_vllm_config_or_none()
    if current is None:
        raise RuntimeError("dump-default: no current vLLM config during load_weights")
    spec = current.speculative_config
    if spec is not None and model_config is spec.draft_model_config:
        return "draft"
    if model_config is current.model_config:
        return "target"
    raise RuntimeError("dump-default: model_config is neither the target's nor the draft's")


def dump_path(role: str) -> Path:
    """``$SHARDPREP_DUMP_DIR/{role}-pp{P}-tp{T}.safetensors`` for this rank."""
    root = os.environ.get(DUMP_DIR_ENV)
    if not root:
        raise RuntimeError(f"dump-default needs {DUMP_DIR_ENV} in the environment")
    pp_rank = get_pp_group().rank_in_group
    tp_rank = get_tensor_model_parallel_rank()
    return Path(root) / f"{role}-pp{pp_rank}-tp{tp_rank}.safetensors"


def rank_metadata(model: nn.Module, model_config: ModelConfig, role: str) -> dict[str, object]:
    """What the dump records besides the tensors (all JSON values)."""
    pp = get_pp_group()
    current = get_current_vllm_config_or_none()
    return {
        "role": role,
        "is_current_model_config": current is not None and model_config is current.model_config,
        "pp_rank": pp.rank_in_group,
        "pp_size": pp.world_size,
        "tp_rank": get_tensor_model_parallel_rank(),
        "model_class": type(model).__name__,
        "model": model_config.model,
        "dtype": str(model_config.dtype),
        "has_own_lm_head": getattr(model, "has_own_lm_head", None),
        "has_own_embed_tokens": getattr(model, "has_own_embed_tokens", None),
    }


class DumpDefaultLoader(BaseModelLoader):
    """Loads with ``DefaultModelLoader`` and saves the rank's parameters before processing."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.inner = self.make_inner(load_config)

    @staticmethod
    def make_inner(load_config: LoadConfig) -> BaseModelLoader:
        inner_config = replace(load_config, load_format="auto", model_loader_extra_config={})
        return DefaultModelLoader(inner_config)

    def download_model(self, model_config: ModelConfig) -> None:
        self.inner.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        self.inner.load_weights(model, model_config)
        role = model_role(model_config)
        save_state(model, dump_path(role), rank_metadata(model, model_config, role))


class DumpShardedFastLoader(DumpDefaultLoader):
    """Loads with shardprep's ``sharded-fast`` loader and dumps the same way, so that what
    it leaves in vLLM's model can be compared with what the default loader leaves. With
    ``$SHARDPREP_TRAP_COLLECTIVES=1`` every collective (torch.distributed and vLLM's group
    coordinators) fails during the load; the dump records that the trap was armed."""

    @staticmethod
    def make_inner(load_config: LoadConfig) -> BaseModelLoader:
        from shardprep.loader.plugin import ShardedFastLoader

        return ShardedFastLoader(replace(load_config, load_format="sharded-fast"))

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        if os.environ.get(TRAP_ENV) != "1":
            super().load_weights(model, model_config)
            return
        with trapped_collectives() as trap:
            self.inner.load_weights(model, model_config)
        role = model_role(model_config)
        meta = rank_metadata(model, model_config, role) | trap
        save_state(model, dump_path(role), meta)


TRAP_ENV = "SHARDPREP_TRAP_COLLECTIVES"
TORCH_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list",
    "recv_object_list", "batch_isend_irecv", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip
COORDINATOR_METHODS = (
    "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "reduce_scatterv", "gather",
    "broadcast", "broadcast_object", "broadcast_object_list", "broadcast_tensor_dict",
    "send_object", "recv_object", "send_tensor_dict", "recv_tensor_dict", "send", "recv",
    "barrier",
)  # fmt: skip


@contextlib.contextmanager
def trapped_collectives() -> Iterator[dict[str, object]]:
    """Patch every collective to record its name and raise, check that a real barrier is
    refused, and restore everything afterwards. Yields the metadata to record."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group
    from vllm.distributed.parallel_state import GroupCoordinator

    calls: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def refuse(name: str) -> Callable[..., None]:
        def refused(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise RuntimeError(f"{name} was called during a rank-local load")

        return refused

    targets = [(dist, n, f"torch.distributed.{n}") for n in TORCH_COLLECTIVES]
    targets += [(GroupCoordinator, n, f"GroupCoordinator.{n}") for n in COORDINATOR_METHODS]
    for owner, name, label in targets:
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, refuse(label))
    try:
        try:
            get_tp_group().barrier()
            armed = False
        except RuntimeError:
            armed = calls == ["GroupCoordinator.barrier"]
        calls.clear()
        meta: dict[str, object] = {"collectives_trapped": len(saved), "trap_armed": armed}
        yield meta
        meta["collective_calls"] = list(calls)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
