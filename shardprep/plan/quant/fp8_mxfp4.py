"""fp8 blocks with e8m0 scales and MXFP4 experts under the checkpoint's own names: the
quantization DeepSeek-V4 is published in (`quant_method: fp8`, `scale_fmt: ue8m0`,
`weight_block_size` [128, 128], `expert_dtype: fp4`), as vLLM's `DeepseekV4FP8Config`
loads it.

A quantized linear weight `x.weight` [N, K] is stored as float8_e4m3fn with its block
scales beside it as `x.scale` (F8_E8M0, [ceil(N/128), ceil(K/128)]); vLLM's weights
mapper renames the scale `x.weight_scale_inv`, which `Fp8LinearMethod` builds as
float8_e8m0fnu (`is_scale_e8m0`) and cuts in whole blocks as any fp8 block scale. A routed
expert's `x.weight` holds e2m1 values two to a byte (I8, [N, K/2]) and `x.scale` one e8m0
exponent per 32 of them (F8_E8M0, [N, K/32]); `Mxfp4MoEMethod` stacks them into uint8
`w13_weight`/`w2_weight` and `w13_weight_scale`/`w2_weight_scale` (gate rows then up rows
of the rank; the rank's packed or grouped K columns), the bytes kept as they are (the
loader views the e8m0 scales as uint8; the int8 values are copied into uint8). Its
backends pad the stacks as `Mxfp4PackMoeQuant` says; the rank files hold them unpadded
and the loader pads them for the backend that runs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import ClassVar

from shardprep.plan.cuts import Piece
from shardprep.plan.quant.base import EXPONENTS, FP8_VALUES, MXFP4, Example
from shardprep.plan.quant.fp4 import GROUP, PER_BYTE, Mxfp4PackMoeQuant
from shardprep.plan.quant.fp8 import FP8, BlockQuant
from shardprep.plan.quant.layer import Quantized, QuantParams

E8M0 = "F8_E8M0"  # the checkpoint's scales, linear and expert alike
PACKED = "I8"  # the experts' e2m1 pairs, as the checkpoint stores them
BYTE = "U8"  # vLLM's MXFP4 stacks and their scales


def scale_of(weight: str) -> str:
    """`x.weight` -> `x.scale`, the checkpoint's name of its scales."""
    return weight.removesuffix("weight") + "scale"


def _any_number(name: str) -> str:
    """A pattern of `name` whose numbered parts (`layers.3.`, `experts.11.`) match any."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


@dataclass(frozen=True)
class Fp8Mxfp4Quant(BlockQuant):
    name: ClassVar[str] = "fp8_e8m0_mxfp4"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "deepseek_v4_fp8"  # vLLM's quantization method, as it overrides it
    kv_cache_scales: ClassVar[bool] = False  # `DeepseekV4FP8Config` maps none

    # A pattern of the routed experts' weights, which are MXFP4 (`re.search`); every other
    # quantized weight is an fp8 linear layer.
    experts_pattern: str = "$^"

    def is_expert(self, weight: str) -> bool:
        return re.search(self.experts_pattern, weight) is not None

    def for_experts(self, experts: Collection[str]) -> Fp8Mxfp4Quant:
        """The scheme whose pattern matches `experts`' names at any layer or expert number."""
        forms = sorted({_any_number(name) for name in experts})
        pattern = f"^(?:{'|'.join(forms)})$" if forms else "$^"
        return dataclasses.replace(self, experts_pattern=pattern)

    def weight_shape(
        self, weight: str, shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[int, ...] | None:
        """An expert's weight [N, K] of its packed bytes [N, K/2]; a linear one's own."""
        if self.is_expert(weight):
            return self.unpacked_shape(weight, shapes, weight, PER_BYTE)
        return super().weight_shape(weight, shapes)

    @property
    def experts(self) -> Mxfp4PackMoeQuant:
        return Mxfp4PackMoeQuant(GROUP)

    @property
    def describe(self) -> str:
        return f"fp8 blocks {list(self.block)} with e8m0 scales, mxfp4 experts"

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        rows, cols = shape
        if self.is_expert(weight):
            return {
                weight: ((rows, cols // PER_BYTE), PACKED),
                scale_of(weight): ((rows, cols // GROUP), E8M0),
            }
        return {weight: (shape, FP8), scale_of(weight): (self.scale_shape(shape), E8M0)}

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """A random expert weight encoded in MXFP4; fp8 values and e8m0 block scales."""
        if self.is_expert(weight):
            rows, cols = shape  # the values the packed bytes hold
            return {
                weight: Example(MXFP4, (rows, cols // PER_BYTE * PER_BYTE), (scale_of(weight),))
            }
        return {weight: Example(FP8_VALUES), scale_of(weight): Example(EXPONENTS)}

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """An fp8 weight and its e8m0 `weight_scale_inv`, or an expert stack and its
        `_scale` (uint8), each scale piece read from the checkpoint's `x.scale`."""
        if pieces[0].expert is None:
            parts, unplaced = super().params(name, pieces, shapes, tp, moe_ways)
            (weight, scales) = parts
            renamed = tuple(
                s._replace(source=scale_of(p.source))
                for s, p in zip(scales[1], pieces, strict=True)
            )
            return [weight, (scales[0], renamed, E8M0)], unplaced
        parts, unplaced = self.experts.params(name, pieces, shapes, tp, moe_ways)
        (stack, packed, _), (scale, grouped, _) = parts
        packed = tuple(s._replace(source=p.source) for s, p in zip(packed, pieces, strict=True))
        grouped = tuple(
            s._replace(source=scale_of(p.source)) for s, p in zip(grouped, pieces, strict=True)
        )
        return [(stack, packed, BYTE), (scale, grouped, BYTE)], unplaced

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """fp8's block checks of a linear layer; MXFP4's groups of experts."""
        if layer.kind == "experts":
            return self.experts.refusals(layer, tp, moe_ways)
        return super().refusals(layer, tp, moe_ways)
