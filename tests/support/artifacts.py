"""Reading a converted artifact back in tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from shardprep.format.manifest import read_manifest


def rank_tensors(artifact: Path, role: str, pp: int, tp: int) -> dict[str, torch.Tensor]:
    """Every tensor of one rank's files (`role` "target" or "draft"), each from one part."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in read_manifest(artifact).rank_files(role, pp, tp):
        part = load_file(artifact / entry.path)
        assert not set(part) & set(tensors), "a parameter appears in two parts"
        tensors.update(part)
    return tensors
