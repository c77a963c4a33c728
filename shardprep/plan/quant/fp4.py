"""compressed-tensors `mxfp4-pack-quantized` (Kimi-K3's routed experts): e2m1 values two to
a byte with one e8m0 exponent per group of 32, only the routed experts quantized and
everything else in the `ignore` list.

Each quantized weight `x.weight` [N, K] is stored as `x.weight_packed` uint8 [N, K/2] and
`x.weight_scale` uint8 [N, K/32]. vLLM's `CompressedTensorsW4A4Mxfp4MoEMethod` stacks
them as FusedMoE does any weight (`w13_weight_packed`, `w13_weight_scale`: gate rows then
up rows of the rank; `w2_*`: the rank's packed or grouped K columns), without padding;
the per-rank intermediate size must be whole groups of 32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.layout import Cut, Piece, ScaleOf
from shardprep.plan.quant.int4 import PackQuant
from shardprep.plan.quant.layer import Quantized

Config = Mapping[str, Any]
BYTE = "U8"
PER_BYTE = 2  # e2m1 values to a byte
GROUP = 32  # values that share one e8m0 exponent
FORMAT = "mxfp4-pack-quantized"
SUPPORTED = (
    "shardprep supports compressed-tensors mxfp4-pack-quantized (one config group targeting "
    "Linear: 4-bit float weights in symmetric groups of 32)"
)


@dataclass(frozen=True)
class Mxfp4PackQuant(PackQuant):
    name: ClassVar[str] = "mxfp4_pack"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "compressed-tensors"  # vLLM's quantization method

    @property
    def describe(self) -> str:
        return f"mxfp4 groups of {self.group}"

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        rows, cols = shape
        return {
            weight + "_packed": ((rows, cols // PER_BYTE), BYTE),
            weight + "_scale": ((rows, cols // self.group), BYTE),
        }

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> tuple[list[tuple[str, tuple[Piece, ...], str | None]], dict[str, str]]:
        """`w13_weight_packed`/`w2_weight_packed` and their group scales, uint8."""

        def packed(suffix: str, per: int) -> tuple[Piece, ...]:
            return tuple(
                Piece(
                    p.source + suffix,
                    Cut.PACKED,
                    expert=p.expert,
                    scale_of=ScaleOf(tuple(shapes[p.source]), p.cut, (1, per), None, p.heads),  # type: ignore[arg-type]
                )
                for p in pieces
            )

        return [
            (name + "_packed", packed("_packed", PER_BYTE), BYTE),
            (name + "_scale", packed("_scale", self.group), BYTE),
        ], {}

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """Sizes vLLM's parameters cannot hold whole: its stacks are [.., size // 32]."""
        if layer.kind != "experts":
            return []
        name, hidden, inter = layer.name, layer.input, layer.outputs[0][0]
        local = inter // moe_ways
        for what, size in (("hidden_size", hidden), ("intermediate size per rank", local)):
            if size % self.group:
                return [
                    f"{name}: MXFP4 MoE stores the {what} ({size}) in groups of "
                    f"{self.group}, which it does not divide."
                ]
        return []


def mxfp4_pack_quant(quant: Config) -> Mxfp4PackQuant:
    """The scheme of a compressed-tensors `mxfp4-pack-quantized` config; one it cannot lay
    out comes back with its `problem` set."""
    refused = _refusal(quant)
    if refused:
        return Mxfp4PackQuant(GROUP, f"quantization_config is {FORMAT} with {refused}; {SUPPORTED}")
    return Mxfp4PackQuant(GROUP, ignored=tuple(quant.get("ignore") or []))


def _refusal(quant: Config) -> str:
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        return f"{len(groups) if isinstance(groups, Mapping) else 'no'} config groups"
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping):
        return "a config group without weights"
    if "Linear" not in (group.get("targets") or []):
        return f"targets {group.get('targets')!r}"
    wanted = {"num_bits": 4, "type": "float", "strategy": "group", "symmetric": True}
    wanted["group_size"] = GROUP
    for key, value in wanted.items():
        if weights.get(key) != value:
            return f"weights {key} {weights.get(key)!r}"
    inputs = group.get("input_activations")
    if inputs and inputs.get("num_bits") == 8:
        return "8-bit activations (W4A8)"
    if quant.get("kv_cache_scheme"):
        return "a kv_cache_scheme"
    ignored = quant.get("ignore") or []
    if not isinstance(ignored, list) or not all(isinstance(n, str) for n in ignored):
        return "an ignore list that is not a list of names"
    return ""
