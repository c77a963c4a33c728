"""compressed-tensors fp8 (`format: float-quantized`, W8A8 fp8), as llm-compressor
publishes it (the `-FP8-dynamic`, `-FP8` and `-FP8-BLOCK` checkpoints), and as vLLM's
`CompressedTensorsW8A8Fp8` and `CompressedTensorsW8A8Fp8MoEMethod` build it before
`process_weights_after_loading`.

Each quantized weight `x.weight` [N, K] is stored fp8 with `x.weight_scale` in the model's
dtype, by the weights' `strategy`: `tensor` [1], `channel` [N, 1], `block`
[ceil(N/bn), ceil(K/bk)]; static activations add `x.input_scale` [1]. vLLM holds every
scale in float32 under the same name:

- tensor: one scale per part of a fused layer (as fp8 per tensor, `Cut.PER_TENSOR`);
  experts `w13_weight_scale` [E, 2], `w2_weight_scale` [E];
- channel: cut with the weight's rows (`qkv_proj`, `gate_up_proj`, `w13_weight_scale`
  [E, 2I/tp, 1]); whole where the weight is cut by columns (`o_proj`, `down_proj`,
  `w2_weight_scale` [E, H, 1]);
- block: by whole blocks as fp8 blocks (`Cut.BLOCK_SCALE`), with no refinement for experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.cuts import Cut, Piece, ScaleOf, matrix
from shardprep.plan.quant.base import FP8_VALUES, PLAIN, Example, Scheme
from shardprep.plan.quant.fp8 import BlockQuant, block_size, moe_block_rules
from shardprep.plan.quant.fp8_tensor import input_scale
from shardprep.plan.quant.ignore import config_group, ignore_list_refusal, ignored
from shardprep.plan.quant.layer import Quantized, QuantParams

Config = Mapping[str, Any]
FP8 = "F8_E4M3"
SCALE_DTYPE = "F32"
STRATEGIES = ("tensor", "channel", "block")
SUPPORTED = (
    "shardprep supports compressed-tensors float-quantized fp8 (one config group targeting "
    "Linear, 8-bit float symmetric static weights by tensor, channel or block, dynamic "
    "activations or static ones per tensor)"
)


@dataclass(frozen=True)
class FloatQuant(Scheme):
    name: ClassVar[str] = "fp8_ct"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "compressed-tensors"  # vLLM's quantization method
    param_suffixes: ClassVar[tuple[str, ...]] = ("_scale", "input_scale")

    strategy: str  # the weights' strategy: "tensor", "channel" or "block"
    block: tuple[int, int] = (1, 1)  # (block_n, block_k) of the block strategy
    static: bool = False  # static activation scales (per tensor): an input_scale each
    activations: str = "token"  # the activations' strategy
    problem: str = ""  # why vLLM cannot load this quantization, if it cannot
    # The `ignore` list: exact layer names, or `re:` patterns matched from the start.
    ignored: tuple[str, ...] = ()

    @property
    def describe(self) -> str:
        what = f"blocks {list(self.block)}" if self.strategy == "block" else f"per {self.strategy}"
        return f"fp8 {what}" + (", static activation scales" if self.static else "")

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """The checkpoint tensors of one quantized weight: {name: (shape, dtype)}, ""
        for the model's dtype."""
        rows, cols = shape
        scale: tuple[int, ...] = (1,)
        if self.strategy == "channel":
            scale = (rows, 1)
        elif self.strategy == "block":
            scale = (-(-rows // self.block[0]), -(-cols // self.block[1]))
        tensors = {weight: (shape, FP8), weight + "_scale": (scale, "")}
        if self.static:
            tensors[input_scale(weight)] = ((1,), "")
        return tensors

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """The fp8 weight; its scales are in the model's dtype."""
        return {name: Example(PLAIN) for name in self.stored(weight, shape)} | {
            weight: Example(FP8_VALUES)
        }

    def skips(self, layer: str, *parts: str) -> bool:
        """Whether vLLM leaves a layer unquantized (`should_ignore_layer`)."""
        return ignored(self.ignored, layer, *parts)

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """The fp8 weight parameter `name`, its scales and, static, its input scales, as
        (name, pieces, dtype); and the stored tensors vLLM loads nowhere."""
        scales = tuple(self._scale(p, shapes) for p in pieces)
        params = [(name, pieces, FP8), (name + "_scale", scales, SCALE_DTYPE)]
        if not self.static:
            return params, {}
        inputs, unplaced = pieces, {}
        if pieces[0].expert is not None:  # one input scale per expert, equal for gate and up
            last = {p.expert: p for p in pieces}
            inputs = tuple(last.values())
            unplaced = {
                input_scale(p.source): (
                    "the input scale of gate_proj: vLLM keeps one of gate and up per "
                    "expert and refuses a checkpoint where they differ"
                )
                for p in pieces
                if p is not last[p.expert]
            }
        per_input = tuple(
            Piece(input_scale(p.source), Cut.PER_TENSOR, expert=p.expert) for p in inputs
        )
        params.append((input_scale(name), per_input, SCALE_DTYPE))
        return params, unplaced

    def _scale(self, piece: Piece, shapes: Mapping[str, tuple[int, ...]]) -> Piece:
        source = piece.source + "_scale"
        if self.strategy == "tensor":
            return Piece(source, Cut.PER_TENSOR, expert=piece.expert)
        if self.strategy == "channel":  # a row-parallel weight's scales are whole
            cut = Cut.REPLICATE if piece.cut is Cut.COLS else piece.cut
            return Piece(source, cut, piece.heads, piece.expert)
        shape = matrix(shapes[piece.source], piece.source)
        of = ScaleOf(shape, piece.cut, self.block, None, piece.heads)
        return Piece(source, Cut.BLOCK_SCALE, expert=piece.expert, scale_of=of)

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """vLLM's refusals of one layer at `tp`, in its words."""
        if layer.kind == "experts":
            if self.strategy == "tensor" and self.activations != "tensor":
                why = "per-tensor weights need per-tensor activations"
                return [f"{layer.name}: vLLM's fp8 MoE refuses this scheme: {why}"]
            if self.strategy == "channel" and (self.static or self.activations != "token"):
                why = "per-channel weights need dynamic per-token activations"
                return [f"{layer.name}: vLLM's fp8 MoE refuses this scheme: {why}"]
            if self.strategy != "block":
                return []
            local = layer.outputs[0][0] // moe_ways
            return [f"{layer.name}: {p}" for p in moe_block_rules(self.block, local, moe_ways)]
        if self.strategy != "block":
            return []
        return BlockQuant(self.block).refusals(layer, tp, moe_ways)


def float_quant(quant: Config) -> FloatQuant:
    """The fp8 scheme of a compressed-tensors `float-quantized` `quantization_config`;
    one it cannot lay out comes back with its `problem` set."""
    refused = _refusal(quant)
    if refused:
        why = f"quantization_config is compressed-tensors with {refused}; {SUPPORTED}"
        return FloatQuant("tensor", problem=why)
    (group,) = quant["config_groups"].values()
    weights, inputs = group["weights"], group["input_activations"]
    return FloatQuant(
        weights["strategy"],
        block_size(weights.get("block_structure")) or (1, 1),
        static=not inputs.get("dynamic"),
        activations=str(inputs.get("strategy")),
        ignored=tuple(quant.get("ignore") or []),
    )


def _refusal(quant: Config) -> str:
    """What of a compressed-tensors fp8 config shardprep does not lay out, or ""."""
    wanted = {"num_bits": 8, "type": "float", "symmetric": True}
    group, weights, refused = config_group(quant, wanted)
    if refused:
        return refused
    if weights.get("dynamic"):
        return "dynamic weights"
    if weights.get("strategy") not in STRATEGIES:
        return f"weights strategy {weights.get('strategy')!r}"
    block = weights.get("block_structure")
    if weights["strategy"] == "block" and block_size(block) is None:
        return f"weights block_structure {block!r}"
    inputs = group.get("input_activations")
    if not isinstance(inputs, Mapping):
        return "no input_activations (fp8 weights only, W8A16)"
    if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
        return f"input_activations of type {inputs.get('type')!r}"
    if not inputs.get("dynamic") and (
        inputs.get("strategy") != "tensor" or not inputs.get("symmetric")
    ):
        return f"static input_activations by {inputs.get('strategy')!r}"
    if weights["strategy"] == "block" and not inputs.get("dynamic"):
        return "static input_activations with block weights"
    if group.get("output_activations"):
        return "quantized output activations"
    if quant.get("kv_cache_scheme"):
        return "a kv_cache_scheme"
    return ignore_list_refusal(quant)
