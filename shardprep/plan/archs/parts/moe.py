"""What the mixture-of-experts families share: vLLM's FusedMoE parameters.

FusedMoE stacks the routed experts of a layer into
`<prefix>.experts.routed_experts.w13_weight` [E_local, 2I/tp, H] (per expert: gate rows
then up rows of this rank) and `...routed_experts.w2_weight` [E_local, H, I/tp] (down_proj
columns); the router (`<prefix>.gate.weight`, [E, H]) is replicated (vLLM's runner also
lists it as `<prefix>.experts.gate.weight`, the same tensor). Which experts a rank holds
and how they are cut is the plan's `ExpertSplit`; this module only names the pieces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from shardprep.plan.archs.base import Param
from shardprep.plan.archs.parts.names import LAYER
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.experts import w2_pieces, w13_pieces

EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:[\w]+\.)?experts)\.\d+\.(.+)$")


@dataclass(frozen=True)
class ExpertNames:
    """How one family names an expert's three projections in the checkpoint."""

    gate: str  # e.g. "gate_proj.weight" (Mixtral: "w1.weight")
    up: str
    down: str

    def weights(self, names: Iterable[str]) -> dict[str, str]:
        """{source weight: vLLM layer} of the expert projections among `names`."""
        suffixes = {self.gate, self.up, self.down}
        return {
            name: match[1]
            for name in names
            if (match := EXPERT.match(name)) and match[2] in suffixes
        }

    def shapes(self, prefix: str, experts: int, inter: int, hidden: int) -> dict[str, tuple]:
        shapes: dict[str, tuple[int, ...]] = {}
        for e in range(experts):
            shapes[f"{prefix}{e}.{self.gate}"] = (inter, hidden)
            shapes[f"{prefix}{e}.{self.up}"] = (inter, hidden)
            shapes[f"{prefix}{e}.{self.down}"] = (hidden, inter)
        return shapes


def expert_params(
    names: ExpertNames, hf_prefix: str, vllm_prefix: str, num_experts: int, stage: int
) -> list[Param]:
    """The two expert stacks of one layer. `hf_prefix` ends where the expert index goes
    ("model.layers.3.mlp.experts."); `vllm_prefix` is where vLLM keeps the stacks
    ("model.layers.3.mlp.experts.routed_experts.")."""
    experts = range(num_experts)
    gate_up = [(f"{hf_prefix}{e}.{names.gate}", f"{hf_prefix}{e}.{names.up}") for e in experts]
    down = [f"{hf_prefix}{e}.{names.down}" for e in experts]
    return [
        Param(f"{vllm_prefix}w13_weight", w13_pieces(gate_up), (stage,)),
        Param(f"{vllm_prefix}w2_weight", w2_pieces(down), (stage,)),
    ]


def every_stage_params(
    tied: bool, present: Iterable[str], pp: int
) -> tuple[list[Param], dict[str, str]]:
    """Embedding, final norm and lm_head, which these families build and load on every
    pipeline stage; a tied lm_head is the embedding."""
    stages = tuple(range(pp))
    params = [
        Param(
            "model.embed_tokens.weight", (Piece("model.embed_tokens.weight", Cut.VOCAB),), stages
        ),
        Param("model.norm.weight", (Piece("model.norm.weight", Cut.REPLICATE),), stages),
    ]
    skipped = {}
    if not tied:
        params.append(Param("lm_head.weight", (Piece("lm_head.weight", Cut.VOCAB),), stages))
    elif "lm_head.weight" in present:
        skipped["lm_head.weight"] = "tied to model.embed_tokens.weight"
    return params, skipped


def top_level_shapes(vocab: int, hidden: int, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def group_layers(names: Iterable[str]) -> dict[int, list[str]]:
    """Source names by layer index (names outside the layers are left out)."""
    layers: dict[int, list[str]] = {}
    for name in names:
        match = LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    return layers


def moe_problems(
    *,
    num_experts: int,
    moe_intermediate: int,
    tp: int,
    dp: int,
    expert_parallel: bool,
) -> list[str]:
    """Sizes that vLLM's FusedMoE refuses at this topology, as full sentences."""
    size = tp * dp
    if expert_parallel and size > 1:
        if num_experts < size:
            return [
                f"expert parallelism over tp x dp = {size} ranks needs at least {size} experts, "
                f"the model has {num_experts}; choose a smaller tp x dp"
            ]
        return []
    if moe_intermediate % size:
        return [
            f"the experts' intermediate size ({moe_intermediate}) is not divisible by "
            f"tp x dp = {size}; choose sizes that divide it, or --enable-expert-parallel"
        ]
    return []
