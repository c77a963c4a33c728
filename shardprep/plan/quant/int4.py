"""compressed-tensors `pack-quantized` int4 (W4A16), as Kimi-K2-Thinking, K2.5 and K2.6
publish it: group-quantized symmetric int4 routed experts, everything else in the
`ignore` list.

Each quantized weight `x.weight` [N, K] is stored as `x.weight_packed` int32
[N, ceil(K/8)] (eight values to an int32 along K), `x.weight_scale` [N, K/group] in the
model's dtype and `x.weight_shape` int32 [2] (= [N, K]). vLLM's
`CompressedTensorsWNA16MoEMethod` stacks them like the weights (`w13_weight_packed`,
`w13_weight_scale`: gate rows then up rows of the rank; `w2_*`: the rank's packed or
grouped K columns) and keeps one full, unsharded [N, K] per expert in `w13_weight_shape`
/ `w2_weight_shape` ([E, 2], the model's dtype) on every rank: of gate and up, whose
shapes it writes into the same row, the one it reads last (up's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.cuts import MODEL_DTYPE, Cut, Piece, ScaleOf, matrix
from shardprep.plan.quant.base import INT32, PLAIN, SHAPE, Example, Scheme
from shardprep.plan.quant.ignore import config_group, ignore_list_refusal, ignored
from shardprep.plan.quant.layer import Quantized, QuantParams

Config = Mapping[str, Any]
PACKED_DTYPE = "I32"  # the packed weights' and the checkpoint's weight_shape safetensors dtype
SUFFIXES = ("_packed", "_scale", "_shape")
BITS = 4
PER_INT32 = 32 // BITS
# What a parsed scheme holds when config.json's quantization cannot be laid out.
SUPPORTED = (
    "shardprep supports compressed-tensors pack-quantized int4 (W4A16: one config group "
    "targeting Linear, group strategy, symmetric, no activation quantization)"
)


@dataclass(frozen=True)
class PackQuant(Scheme):
    name: ClassVar[str] = "int4_pack"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "compressed-tensors"  # vLLM's quantization method
    param_suffixes: ClassVar[tuple[str, ...]] = SUFFIXES

    group: int  # the group size along K: one scale per group of input columns
    problem: str = ""  # why vLLM cannot load this quantization, if it cannot
    # The `ignore` list: exact layer names, or `re:` patterns matched from the start.
    ignored: tuple[str, ...] = ()

    @property
    def describe(self) -> str:
        return f"int4 groups of {self.group}"

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """The checkpoint tensors of one quantized weight: {name: (shape, dtype)}, ""
        for the model's dtype."""
        rows, cols = shape
        return {
            weight + "_packed": ((rows, -(-cols // PER_INT32)), PACKED_DTYPE),
            weight + "_scale": ((rows, -(-cols // self.group)), ""),
            weight + "_shape": ((2,), PACKED_DTYPE),
        }

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """Random packed values, scales in the model's dtype, the weight's true [N, K]."""
        return {
            weight + "_packed": Example(INT32),
            weight + "_scale": Example(PLAIN),
            weight + "_shape": Example(SHAPE, tuple(shape)),
        }

    def logical(self, source: str) -> str:
        """The weight a stored tensor holds (`x.weight_packed` -> `x.weight`)."""
        return source.removesuffix("_packed")

    def weight_shape(
        self, weight: str, shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[int, ...] | None:
        """[N, K] of `x.weight_packed` [N, K/8] (vLLM packs whole int32s along K)."""
        return self.unpacked_shape(weight, shapes, weight + "_packed", PER_INT32)

    def skips(self, layer: str, *parts: str) -> bool:
        """Whether vLLM leaves a layer unquantized (`should_ignore_layer`; see
        `ignore.ignored`)."""
        return ignored(self.ignored, layer, *parts)

    def places(self, kind: str) -> bool:
        """Whether shardprep lays out a quantized layer of this kind: the experts only."""
        return kind == "experts"

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """The parameters vLLM builds for one quantized parameter `name` made of `pieces`
        (of the unquantized weights, whose shapes `shapes` gives), as (name, pieces,
        dtype or None for the model's), and the stored tensors it loads nowhere."""

        def packed(suffix: str, per: int) -> tuple[Piece, ...]:
            return tuple(
                Piece(
                    p.source + suffix,
                    Cut.PACKED,
                    expert=p.expert,
                    scale_of=ScaleOf(
                        matrix(shapes[p.source], p.source), p.cut, (1, per), None, p.heads
                    ),
                )
                for p in pieces
            )

        last = {p.expert: p for p in pieces}  # the part vLLM loads last (up: after gate)
        shape = tuple(
            Piece(p.source + "_shape", Cut.REPLICATE, expert=p.expert) for p in last.values()
        )
        # A FusedMoE stack holds its shapes in the model's dtype, a linear layer in int64.
        shape_dtype = MODEL_DTYPE if pieces[0].expert is not None else "I64"
        unplaced = {
            p.source + "_shape": (
                "the shape of an earlier part of a fused parameter: vLLM keeps one [N, K] of "
                "each expert or layer, the last part's (up's), equal in a consistent checkpoint"
            )
            for p in pieces
            if p is not last[p.expert]
        }
        return [
            (name + "_packed", packed("_packed", PER_INT32), PACKED_DTYPE),
            (name + "_scale", packed("_scale", self.group), None),
            (name + "_shape", shape, shape_dtype),
        ], unplaced

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """vLLM's `CompressedTensorsWNA16MoEMethod.create_weights` refusals, in its words."""
        if layer.kind != "experts":
            return []  # not laid out at all: see `places`
        name, hidden, inter = layer.name, layer.input, layer.outputs[0][0]
        if hidden % self.group:
            return [
                f"{name}: CompressedTensors WNA16 MoE requires hidden_size ({hidden}) to be "
                f"divisible by group_size ({self.group})."
            ]
        local = inter // moe_ways
        if local % self.group:
            return [
                f"{name}: CompressedTensors WNA16 MoE with static group scales requires the "
                f"MoE intermediate size per tensor-parallel partition ({local}) to be "
                f"divisible by group_size ({self.group})."
            ]
        return []


def pack_quant(quant: Config) -> PackQuant:
    """The int4 scheme of a compressed-tensors `quantization_config`; one it cannot lay out
    comes back with its `problem` set."""
    refused = _refusal(quant)
    if refused:
        why = f"quantization_config is compressed-tensors with {refused}; {SUPPORTED}"
        return PackQuant(1, why)
    (group,) = quant["config_groups"].values()
    ignored = quant.get("ignore") or []
    return PackQuant(int(group["weights"]["group_size"]), ignored=tuple(ignored))


def _refusal(quant: Config) -> str:
    """What of a compressed-tensors config shardprep does not lay out, or ""."""
    if quant.get("format") != "pack-quantized":
        return f"format {quant.get('format')!r}"
    wanted = {"num_bits": BITS, "type": "int", "strategy": "group", "symmetric": True}
    group, weights, refused = config_group(quant, wanted)
    if refused:
        return refused
    size = weights.get("group_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"weights group_size {size!r}"
    if weights.get("actorder") or weights.get("dynamic"):
        return "activation ordering or dynamic weights"
    if group.get("input_activations") or group.get("output_activations"):
        return "quantized activations"
    if quant.get("kv_cache_scheme"):
        return "a kv_cache_scheme"
    return ignore_list_refusal(quant)
