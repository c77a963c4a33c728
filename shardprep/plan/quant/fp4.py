"""compressed-tensors fp4: `mxfp4-pack-quantized` (Kimi-K3's routed experts: e2m1 values
two to a byte with one e8m0 exponent per group of 32) and `nvfp4-pack-quantized` (one e4m3
scale per group of 16 and float32 global scales per weight), on routed experts and, NVFP4,
on linear layers too.

Each quantized weight `x.weight` [N, K] is stored as `x.weight_packed` uint8 [N, K/2] and
`x.weight_scale` uint8 [N, K/32]. vLLM's `CompressedTensorsW4A4Mxfp4MoEMethod` stacks
them as FusedMoE does any weight (`w13_weight_packed`, `w13_weight_scale`: gate rows then
up rows of the rank; `w2_*`: the rank's packed or grouped K columns), without padding;
the per-rank intermediate size must be whole groups of 32.

NVFP4 stores `x.weight_packed` uint8 [N, K/2], `x.weight_scale` float8_e4m3fn [N, K/16],
`x.weight_global_scale` and, W4A4, `x.input_global_scale`, float32 [1] each (NVFP4A16 has
no input scale). vLLM's `CompressedTensorsW4A4Nvfp4MoEMethod` stacks the first two as
above and each global scale as a per-tensor scale of FusedMoE
(`_load_per_tensor_weight_scale`): w1's and w3's as [E, 2] (gate, up), w2's as [E], whole
on every rank. Its NVFP4A16 experts are refused: vLLM builds their input global scales too
and loads nothing into them. A linear layer (`CompressedTensorsW4A4Fp4`) cuts
`weight_packed` and `weight_scale` as its weight, in whole bytes and groups, and holds one
global scale per part of a fused layer (`PerTensorScaleParameter`: `qkv_proj` 3,
`gate_up_proj` 2, others 1) on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.cuts import Cut, Piece, ScaleOf, matrix
from shardprep.plan.quant.base import ACTIVATION, BYTES, EXPONENTS, NVFP4, Example
from shardprep.plan.quant.ignore import config_group, ignore_list_refusal
from shardprep.plan.quant.int4 import PackQuant
from shardprep.plan.quant.layer import Quantized, QuantParams

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
    "Linear: 4-bit float weights in symmetric tensor_group groups of 16, activations the same "
    "or none)"
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
    param_suffixes: ClassVar[tuple[str, ...]] = ("_packed", "_scale")

    @property
    def describe(self) -> str:
        return f"{self.kind.lower()} groups of {self.group}"

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        rows, cols = shape
        return {
            weight + "_packed": ((rows, cols // PER_BYTE), BYTE),
            weight + "_scale": ((rows, cols // self.group), self.scale_dtype),
        }

    def weight_shape(
        self, weight: str, shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[int, ...] | None:
        """[N, K] of `x.weight_packed` [N, K/2]."""
        return self.unpacked_shape(weight, shapes, weight + "_packed", PER_BYTE)

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """Random e2m1 pairs and e8m0 exponents."""
        return {weight + "_packed": Example(BYTES), weight + "_scale": Example(EXPONENTS)}

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """`w13_weight_packed`/`w2_weight_packed` and their group scales, uint8."""

        def packed(suffix: str, per: int) -> tuple[Piece, ...]:
            scales: dict[tuple, ScaleOf] = {}  # one per kind: a layer's experts share it
            made = []
            for p in pieces:
                kind = (shapes[p.source], p.cut, p.heads)
                scale = scales.get(kind)
                if scale is None:
                    shape = matrix(kind[0], p.source)
                    scale = scales[kind] = ScaleOf(shape, p.cut, (1, per), None, p.heads)
                made.append(Piece(p.source + suffix, Cut.PACKED, 0, p.expert, scale))
            return tuple(made)

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
class Mxfp4PackMoeQuant(Mxfp4PackQuant):
    """compressed-tensors MXFP4 experts as vLLM loads them through its MXFP4 interface
    (`Mxfp4Config`, `Mxfp4MoEMethod`), where it routes a family's `mxfp4-pack-quantized`
    checkpoint (Kimi-K3: `quant_method` rewritten to `mxfp4`): the stacks are named
    `w13_weight`, `w2_weight` (uint8, two values a byte) and `w13/w2_weight_scale`, cut as
    `Mxfp4PackQuant` cuts them; `Mxfp4Config` has no ignore list and no linear method, so
    every linear layer stays unquantized and every routed expert layer is MXFP4. The
    backend pads a rank's stacks to its alignment (each half of `w13_*` at its end);
    shardprep writes them unpadded and the loader pads them in memory for the backend
    that runs (backend_pad.py)."""

    method: ClassVar[str] = "mxfp4"  # vLLM's quantization method, as it rewrites it

    def skips(self, layer: str, *parts: str) -> bool:
        return False  # the family lists its routed experts only: vLLM quantizes all of them

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """`w13_weight`/`w2_weight` from the `weight_packed` tensors, then the scales."""
        parts, unplaced = super().params(name, pieces, shapes, tp, moe_ways)
        (_, packed, dtype), scale = parts
        return [(name, packed, dtype), scale], unplaced


@dataclass(frozen=True)
class Nvfp4PackQuant(Mxfp4PackQuant):
    name: ClassVar[str] = "nvfp4_pack"
    kind: ClassVar[str] = "NVFP4"
    scale_dtype: ClassVar[str] = E4M3

    a16: bool = False  # NVFP4A16: 16-bit activations, no input global scales

    @property
    def describe(self) -> str:
        return super().describe + (" (weights only, NVFP4A16)" if self.a16 else "")

    @property
    def global_scales(self) -> tuple[str, ...]:
        return GLOBAL_SCALES[:1] if self.a16 else GLOBAL_SCALES

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        stem = weight.removesuffix("weight")
        return super().stored(weight, shape) | {stem + s: ((1,), F32) for s in self.global_scales}

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """A random weight encoded in NVFP4, written with its global scale; W4A4, an
        activation's global scale."""
        stem, (rows, cols) = weight.removesuffix("weight"), shape
        held = (rows, cols // PER_BYTE * PER_BYTE)  # the values the packed bytes hold
        encoded = Example(NVFP4, held, (weight + "_packed", weight + "_scale"))
        found = {stem + GLOBAL_SCALES[0]: encoded}
        if not self.a16:
            found[stem + GLOBAL_SCALES[1]] = Example(ACTIVATION)
        return found

    # Why NVFP4A16 routed experts are refused.
    experts_unplaced: ClassVar[str] = (
        "vLLM builds input scales for them that it never loads; add the experts to the "
        "ignore list or use a W4A4 checkpoint"
    )

    def places(self, kind: str) -> bool:
        """Linear layers and, W4A4, routed experts."""
        return kind != "experts" or not self.a16

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """MXFP4's two stacks or cut tensors, then the global scales: of an expert, whole
        ([E, 2] of a fused gate and up, [E] of a lone part); of a linear layer, one per
        part."""
        parts, unplaced = super().params(name, pieces, shapes, tp, moe_ways)
        if pieces[0].expert is None:
            cut = Cut.PER_TENSOR
        else:
            fused = len(pieces) > len({p.expert for p in pieces})
            cut = Cut.REPLICATE if fused else Cut.EXPERT_SCALAR
        stem = name.removesuffix("weight")
        scales = [
            (stem + scale, tuple(_global_scale(p, scale, cut) for p in pieces), F32)
            for scale in self.global_scales
        ]
        return [*parts, *scales], unplaced

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """The experts' sizes in whole groups, and a linear layer's input columns a rank
        holds: vLLM sizes `weight_scale` [N, K_rank // 16] and cuts it by that many
        groups, so a K_rank that is not whole groups gets another rank's scales."""
        if layer.kind == "experts":
            return super().refusals(layer, tp, moe_ways)
        return linear_group_refusals(layer, tp, self.group, self.kind)


def linear_group_refusals(layer: Quantized, tp: int, group: int, kind: str) -> list[str]:
    """A linear layer's input size on a rank (split by a row-parallel layer, whole
    otherwise) that is not whole groups of `group`."""
    split = layer.kind == "row"
    size = layer.input // tp if split else layer.input
    if size % group == 0 and not (split and layer.input % tp):
        return []
    what = "input size per rank" if split else "input size"
    return [
        f"{layer.name}: {kind} linear stores its {what} ({size}) in groups of {group}, "
        "which it does not divide."
    ]


def nvfp4_pack_quant(quant: Config) -> Nvfp4PackQuant:
    """The scheme of a compressed-tensors `nvfp4-pack-quantized` config; one it cannot lay
    out comes back with its `problem` set."""
    refused = _refusal(quant, NV_GROUP)
    if refused:
        why = f"quantization_config is {NV_FORMAT} with {refused}; {NV_SUPPORTED}"
        return Nvfp4PackQuant(NV_GROUP, why)
    (group,) = quant["config_groups"].values()
    a16 = not group.get("input_activations")
    return Nvfp4PackQuant(NV_GROUP, ignored=tuple(quant.get("ignore") or []), a16=a16)


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
    if inputs and size == NV_GROUP:  # NVFP4 activations, as vLLM's NVFP4 MoE wants
        for key, value in wanted.items():
            if inputs.get(key) != value:
                return f"input_activations {key} {inputs.get(key)!r}"
    if quant.get("kv_cache_scheme"):
        return "a kv_cache_scheme"
    return ignore_list_refusal(quant)


def _global_scale(piece: Piece, scale: str, cut: Cut) -> Piece:
    """The global scale `scale` (a suffix) beside the weight of `piece`."""
    return Piece(piece.source.removesuffix("weight") + scale, cut, expert=piece.expert)
