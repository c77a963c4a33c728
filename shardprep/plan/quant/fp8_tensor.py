"""fp8 per-tensor quantization (`quantization_config.quant_method: fp8` without
`weight_block_size`, as AutoFP8 and llm-compressor's fp8 exports publish it), as vLLM's
`Fp8LinearMethod` and `Fp8MoEMethod` build it before `process_weights_after_loading`.

Each quantized weight `x.weight` [N, K] is stored fp8 with one float32 `x.weight_scale`
(a scalar, or [1]) and, with `activation_scheme: static`, one `x.input_scale`. A linear
layer's `weight_scale` (`PerTensorScaleParameter`) holds one scale per part of the layer
(a fused `qkv_proj`: 3, `gate_up_proj`: 2, any other layer: 1) on every rank, and so does
its `input_scale`. An expert stack holds `w13_weight_scale` [E, 2] (gate, up),
`w2_weight_scale` [E] and, static, `w13_input_scale` [E] and `w2_input_scale` [E]: vLLM
keeps one input scale for gate and up, the one it reads last (up's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant.base import FP8_VALUES, SCALE, Example, Scheme
from shardprep.plan.quant.ignore import not_converted
from shardprep.plan.quant.layer import QuantParams

Config = Mapping[str, Any]
FP8 = "F8_E4M3"
SCALE_DTYPE = "F32"
ACTIVATION_SCHEMES = ("static", "dynamic")


@dataclass(frozen=True)
class TensorQuant(Scheme):
    name: ClassVar[str] = "fp8_tensor"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "fp8"  # vLLM's quantization method
    # `x.weight_scale`, `x.input_scale`; the KV-cache scales a checkpoint ships
    param_suffixes: ClassVar[tuple[str, ...]] = ("_scale", "input_scale")
    kv_cache_scales: ClassVar[bool] = True

    static: bool = False  # activation_scheme static: an input scale per weight
    problem: str = ""  # why vLLM cannot load this quantization, if it cannot
    # Layers vLLM leaves unquantized (`ignored_layers`, else `modules_to_not_convert`),
    # matched exactly against the layer's name as vLLM's `Fp8Config` does.
    ignored: frozenset[str] = frozenset()

    @property
    def describe(self) -> str:
        return "fp8 per tensor" + (", static activation scales" if self.static else "")

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """The checkpoint tensors of one quantized weight: {name: (shape, dtype)}."""
        tensors = {weight: (shape, FP8), weight + "_scale": ((), SCALE_DTYPE)}
        if self.static:
            tensors[input_scale(weight)] = ((), SCALE_DTYPE)
        return tensors

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        return {name: Example(SCALE) for name in self.stored(weight, shape)} | {
            weight: Example(FP8_VALUES)
        }

    def skips(self, *layers: str) -> bool:
        """Whether vLLM leaves a layer unquantized; `layers`: its names (vLLM's fused
        name, then the checkpoint's names of its parts)."""
        return not_converted(self.ignored, *layers)

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """The fp8 weight parameter `name`, its per-tensor scales and, static, its input
        scales, as (name, pieces, dtype); and the stored tensors vLLM loads nowhere."""
        scales = tuple(_scalar(p.source + "_scale", p) for p in pieces)
        params = [(name, pieces, FP8), (name + "_scale", scales, SCALE_DTYPE)]
        if not self.static:
            return params, {}
        unplaced: dict[str, str] = {}
        inputs = pieces
        if pieces[0].expert is not None:  # one input scale per expert: the last part's
            last = {p.expert: p for p in pieces}
            inputs = tuple(last.values())
            unplaced = {
                input_scale(p.source): (
                    "the input scale of gate_proj: vLLM keeps one of gate and up per "
                    "expert, up's, equal to gate's in a consistent checkpoint"
                )
                for p in pieces
                if p is not last[p.expert]
            }
        inputs_param = tuple(_scalar(input_scale(p.source), p) for p in inputs)
        params.append((input_scale(name), inputs_param, SCALE_DTYPE))
        return params, unplaced


def input_scale(weight: str) -> str:
    """`x.weight` -> `x.input_scale` (an expert stack's `w13_weight` -> `w13_input_scale`)."""
    return weight.removesuffix("weight") + "input_scale"


def _scalar(source: str, piece: Piece) -> Piece:
    return Piece(source, Cut.PER_TENSOR, expert=piece.expert)


def tensor_quant(quant: Config, ignored: frozenset[str]) -> TensorQuant:
    """The per-tensor scheme of an fp8 `quantization_config` without a block size."""
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        return TensorQuant(problem=f"fp8 activation_scheme {scheme!r} is not static or dynamic")
    return TensorQuant(scheme == "static", ignored=ignored)
