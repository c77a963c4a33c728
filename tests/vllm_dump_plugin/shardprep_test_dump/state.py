"""Saving a module's parameters exactly as vLLM holds them (no vLLM import here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def parameter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``named_parameters()`` deduplicated as torch does: contiguous CPU clones."""
    return {
        name: param.detach().to("cpu").contiguous().clone()
        for name, param in model.named_parameters()
    }


def parameter_aliases(model: nn.Module) -> dict[str, str]:
    """Names that torch's deduplication dropped, mapped to the name that was kept."""
    kept: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = kept.setdefault(id(param), name)
        if first != name:
            aliases[name] = first
    return aliases


def save_state(model: nn.Module, path: Path, metadata: dict[str, object]) -> Path:
    """Write the parameters of ``model`` to ``path`` atomically, with JSON metadata."""
    meta = {key: json.dumps(value) for key, value in metadata.items()}
    meta["aliases"] = json.dumps(parameter_aliases(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(parameter_state(model), str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path
