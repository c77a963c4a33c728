"""The MoonViT vision tower of the Kimi models (K2.5's, K3's) and its projector, as vLLM
places them: on every pipeline stage, in the model's dtype, never quantized; each tensor
cut by tp when tp divides the tower's heads (`is_vit_use_data_parallel`), whole otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardprep.plan.archs.base import Param
from shardprep.plan.cuts import Cut, Piece

VISION = "vision_tower."
BLOCKS = VISION + "encoder.blocks."
PROJECTOR = "mm_projector."


def tower_params(
    tensors: Mapping[str, tuple[tuple[int, ...], Cut]], split: bool, stages: tuple[int, ...]
) -> list[Param]:
    """vLLM's parameters of a MoonViT tower and its projector (`proj.0/2` as
    `linear_1/2`), each tensor cut as `tensors` says when `split`, whole otherwise."""
    params = []
    for name, (_, cut) in tensors.items():
        cut = cut if split else Cut.REPLICATE
        piece = Piece(name, cut, 3 if cut is Cut.PARTS_ROWS else 0)
        vllm = name.replace("proj.0.", "linear_1.").replace("proj.2.", "linear_2.")
        params.append(Param(vllm, (piece,), stages))
    return params
