"""compressed-tensors fp4 routed experts, everything else in the `ignore` list:
`mxfp4-pack-quantized` (Kimi-K3's: e2m1 values two to a byte with one e8m0 exponent per
group of 32) and `nvfp4-pack-quantized` (one e4m3 scale per group of 16 and float32 global
scales per expert projection).

Each quantized weight `x.weight` [N, K] is stored as `x.weight_packed` uint8 [N, K/2] and
`x.weight_scale` uint8 [N, K/32]. vLLM's `CompressedTensorsW4A4Mxfp4MoEMethod` stacks
them as FusedMoE does any weight (`w13_weight_packed`, `w13_weight_scale`: gate rows then
up rows of the rank; `w2_*`: the rank's packed or grouped K columns), without padding;
the per-rank intermediate size must be whole groups of 32.

NVFP4 stores `x.weight_packed` uint8 [N, K/2], `x.weight_scale` float8_e4m3fn [N, K/16],
`x.weight_global_scale` and `x.input_global_scale`, float32 [1] each (W4A4). vLLM's
`CompressedTensorsW4A4Nvfp4MoEMethod` stacks the first two as above and each global scale
as a per-tensor scale of FusedMoE (`_load_per_tensor_weight_scale`): w1's and w3's as
[E, 2] (gate, up), w2's as [E], whole on every rank. W4A16 (NVFP4A16) is refused: vLLM
builds the input global scales then too and loads nothing into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.layout import Cut, Piece, ScaleOf
from shardprep.plan.quant.ignore import config_group, ignore_list_refusal
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
NV_GROUP = 16  # values that share one e4m3 scale
NV_FORMAT = "nvfp4-pack-quantized"
NV_SUPPORTED = (
    "shardprep supports compressed-tensors nvfp4-pack-quantized (one config group targeting "
    "Linear: 4-bit float weights and activations in symmetric tensor_group groups of 16)"
)
E4M3 = "F8_E4M3"
F32 = "F32"
GLOBAL_SCALES = ("weight_global_scale", "input_global_scale")  # float32 [1] each


@dataclass(frozen=True)
class Mxfp4PackQuant(PackQuant):
    name: ClassVar[str] = "mxfp4_pack"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "compressed-tensors"  # vLLM's quantization method
    kind: ClassVar[str] = "MXFP4"
    scale_dtype: ClassVar[str] = BYTE  # e8m0 exponents

    @property
    def describe(self) -> str:
        return f"{self.kind.lower()} groups of {self.group}"

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        rows, cols = shape
        return {
            weight + "_packed": ((rows, cols // PER_BYTE), BYTE),
            weight + "_scale": ((rows, cols // self.group), self.scale_dtype),
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
            (name + "_scale", packed("_scale", self.group), self.scale_dtype),
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
                    f"{name}: {self.kind} MoE stores the {what} ({size}) in groups of "
                    f"{self.group}, which it does not divide."
                ]
        return []


@dataclass(frozen=True)
class Nvfp4PackQuant(Mxfp4PackQuant):
    name: ClassVar[str] = "nvfp4_pack"
    kind: ClassVar[str] = "NVFP4"
    scale_dtype: ClassVar[str] = E4M3

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        stem = weight.removesuffix("weight")
        return super().stored(weight, shape) | {stem + s: ((1,), F32) for s in GLOBAL_SCALES}

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> tuple[list[tuple[str, tuple[Piece, ...], str | None]], dict[str, str]]:
        """MXFP4's two stacks, then the global scales of each expert, whole: [E, 2] of a
        fused gate and up, [E] of a lone part."""
        parts, unplaced = super().params(name, pieces, shapes, tp, moe_ways)
        fused = len(pieces) > len({p.expert for p in pieces})
        cut = Cut.REPLICATE if fused else Cut.EXPERT_SCALAR
        stem = name.removesuffix("weight")
        for scale in GLOBAL_SCALES:
            of = tuple(
                Piece(p.source.removesuffix("weight") + scale, cut, expert=p.expert) for p in pieces
            )
            parts.append((stem + scale, of, F32))
        return parts, unplaced


def nvfp4_pack_quant(quant: Config) -> Nvfp4PackQuant:
    """The scheme of a compressed-tensors `nvfp4-pack-quantized` config; one it cannot lay
    out comes back with its `problem` set."""
    refused = _refusal(quant, NV_GROUP)
    if refused:
        why = f"quantization_config is {NV_FORMAT} with {refused}; {NV_SUPPORTED}"
        return Nvfp4PackQuant(NV_GROUP, why)
    return Nvfp4PackQuant(NV_GROUP, ignored=tuple(quant.get("ignore") or []))


def mxfp4_pack_quant(quant: Config) -> Mxfp4PackQuant:
    """The scheme of a compressed-tensors `mxfp4-pack-quantized` config; one it cannot lay
    out comes back with its `problem` set."""
    refused = _refusal(quant)
    if refused:
        return Mxfp4PackQuant(GROUP, f"quantization_config is {FORMAT} with {refused}; {SUPPORTED}")
    return Mxfp4PackQuant(GROUP, ignored=tuple(quant.get("ignore") or []))


def _refusal(quant: Config, size: int = GROUP) -> str:
    strategy = "group" if size == GROUP else "tensor_group"
    wanted = {"num_bits": 4, "type": "float", "strategy": strategy, "symmetric": True}
    wanted["group_size"] = size
    group, _, refused = config_group(quant, wanted)
    if refused:
        return refused
    inputs = group.get("input_activations")
    if inputs and inputs.get("num_bits") == 8:
        return "8-bit activations (W4A8)"
    if size == NV_GROUP and not inputs:  # vLLM then builds input scales it never loads
        return "no input_activations (NVFP4A16)"
    if inputs and size == NV_GROUP:  # NVFP4 activations, as vLLM's NVFP4 MoE wants
        for key, value in wanted.items():
            if inputs.get(key) != value:
                return f"input_activations {key} {inputs.get(key)!r}"
    if quant.get("kv_cache_scheme"):
        return "a kv_cache_scheme"
    return ignore_list_refusal(quant)
