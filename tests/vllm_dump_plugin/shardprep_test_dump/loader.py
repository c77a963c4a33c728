"""``DumpDefaultLoader``: vLLM's default loader plus a dump of the loaded parameters."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from vllm.config import ModelConfig, get_current_vllm_config_or_none
from vllm.config.load import LoadConfig
from vllm.config.utils import replace
from vllm.distributed import get_dp_group, get_pp_group, get_tensor_model_parallel_rank
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from shardprep_test_dump import DUMP_DIR_ENV, TRAP_ENV
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
    """``$SHARDPREP_DUMP_DIR/{role}-pp{P}-tp{T}.safetensors`` for this rank; with data
    parallelism, ``{role}-pp{P}-tp{T}-dp{D}.safetensors``."""
    root = os.environ.get(DUMP_DIR_ENV)
    if not root:
        raise RuntimeError(f"dump-default needs {DUMP_DIR_ENV} in the environment")
    pp_rank = get_pp_group().rank_in_group
    tp_rank = get_tensor_model_parallel_rank()
    dp_group = get_dp_group()
    dp = f"-dp{dp_group.rank_in_group}" if dp_group.world_size > 1 else ""
    return Path(root) / f"{role}-pp{pp_rank}-tp{tp_rank}{dp}.safetensors"


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
        **draft_side_effects(model),
    }


def draft_side_effects(model: nn.Module) -> dict[str, object]:
    """What DFlash-style drafts' `load_weights` leaves besides parameters."""
    inner = getattr(model, "model", None)
    if not hasattr(inner, "_build_fused_kv_buffers"):
        return {}
    fused = getattr(inner, "_fused_kv_weight", None)
    expected = None
    if fused is not None:
        layers = [layer.self_attn for layer in inner.layers]
        expected = torch.cat([a.qkv_proj.weight[a.q_size :] for a in layers], dim=0)
    return {
        "fused_kv_buffers": fused is not None and bool(torch.equal(fused, expected)),
        "has_separate_mask_embedding": getattr(inner, "has_separate_mask_embedding", None),
        "has_confidence_head": getattr(inner, "confidence_head", None) is not None,
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
        extra: dict[str, object] = {}
        if os.environ.get(TRAP_ENV) == "1":
            from shardprep_test_dump.trap import collectives_refused

            with collectives_refused() as calls:
                self.inner.load_weights(model, model_config)
            # collectives_refused proves on entry that its patch is in force.
            extra |= {"trap_armed": True, "collectives_trapped": calls.patched}
            extra["collective_calls"] = list(calls)
        else:
            self.inner.load_weights(model, model_config)
        role = model_role(model_config)
        meta = {**rank_metadata(model, model_config, role), **extra}
        save_state(model, dump_path(role), meta)


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
        # Labels the Hub requests of this worker's fetch (the test Hub records them), as
        # HF_HUB_USER_AGENT_ORIGIN would: `origin/{role}-pp{P}-tp{T}` in the User-Agent.
        from huggingface_hub import constants

        pp, tp = get_pp_group().rank_in_group, get_tensor_model_parallel_rank()
        constants.HF_HUB_USER_AGENT_ORIGIN = f"{model_role(model_config)}-pp{pp}-tp{tp}"
        super().load_weights(model, model_config)
