"""What a quantization scheme plug-in is: every hook it may provide, and the example
tensors it declares for the tiny models.

A scheme (`Scheme`) says, for one of vLLM's quantization methods and checkpoint formats,
what a quantized weight is stored as, which layers vLLM leaves unquantized, which
parameters vLLM builds of a quantized parameter and how each is cut, what vLLM refuses
at a tp, and what a tiny model holds in each stored tensor. Every hook has a default
here or must be given by the scheme, so the callers never probe for one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import ClassVar

from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant.layer import Quantized, QuantParams

Shapes = Mapping[str, tuple[int, ...]]

# What a tiny model (demo/) holds in a stored tensor (`Example.kind`):
PLAIN = "plain"  # random values in the model's dtype (a tensor the scheme stores in it)
FP8_VALUES = "fp8"  # random values within ±4, in float8_e4m3fn
SCALE = "scale"  # small positive float32 scales, in [0.01, 0.03)
EXPONENTS = "exponents"  # e8m0 exponents of 2^-8 .. 2^-1, as the tensor's dtype holds them
BYTES = "bytes"  # random bytes (two e2m1 codes to a byte)
INT32 = "int32"  # random int32 (eight int4 values to an int32)
SHAPE = "shape"  # the weight's own shape, int32
ACTIVATION = "activation"  # an activation's global scale, float32 in [100, 500)
# A random weight of shape `Example.weight` encoded in MXFP4: this tensor the e2m1 pairs,
# `writes` its e8m0 scales (each in the shape and dtype the scheme stores).
MXFP4 = "mxfp4"
# ... in NVFP4 as compressed-tensors stores it: this tensor the weight's global scale,
# `writes` the packed values and the e4m3 group scales.
NVFP4 = "nvfp4"
# ... as ModelOpt stores it: this tensor the inverse of the global scale (`weight_scale_2`),
# `writes` the packed values, the group scales and the inverse of an activation scale.
NVFP4_MODELOPT = "nvfp4_modelopt"
EXAMPLE_KINDS = frozenset({PLAIN, FP8_VALUES, SCALE, EXPONENTS, BYTES, INT32, SHAPE})
EXAMPLE_KINDS |= {ACTIVATION, MXFP4, NVFP4, NVFP4_MODELOPT}


@dataclass(frozen=True)
class Example:
    """What a tiny model holds in one stored tensor of a quantized weight."""

    kind: str  # one of EXAMPLE_KINDS
    weight: tuple[int, ...] = ()  # the weight's own shape: what SHAPE holds, what is encoded
    writes: tuple[str, ...] = ()  # the other stored tensors an encoding writes with this one


class Scheme:
    """A quantization scheme. `name` keys its layout revision (format/vllm_layout.py);
    `method` is vLLM's quantization method that loads it."""

    name: ClassVar[str]
    method: ClassVar[str]
    # How the parameters vLLM builds of a quantized weight end, besides the weight's own
    # name (`w13_weight_scale_inv`, `weight_packed`): what report.py groups by.
    param_suffixes: ClassVar[tuple[str, ...]] = ()
    # Whether vLLM's config of the scheme puts the KV-cache scales a checkpoint ships at
    # `self_attn.attn` (`Fp8Config`'s weight mapper; plan/quant/kv_cache.py).
    kv_cache_scales: ClassVar[bool] = False
    # Why quantized routed experts are refused, where `places` refuses them.
    experts_unplaced: ClassVar[str] = ""
    problem: str  # why vLLM cannot load this quantization ("" when it can)

    @property
    def describe(self) -> str:
        """The scheme in a few words, for plans and refusals."""
        return self.name

    def for_request(self, mxfp4_pad: str | None) -> Scheme:
        """The scheme as the conversion request shapes it (`--mxfp4-pad`); most ignore it."""
        return self

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """The checkpoint tensors of one quantized weight of `shape`: {name: (shape,
        dtype)}, "" for the model's dtype."""
        raise NotImplementedError

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """What a tiny model holds in each tensor `stored` names (an encoding's other
        tensors in its `writes`)."""
        raise NotImplementedError

    def logical(self, source: str) -> str:
        """The weight a stored tensor holds: by default the quantized weight keeps its name
        in the checkpoint, its scales beside it."""
        return source

    def weight_shape(self, weight: str, shapes: Shapes) -> tuple[int, ...] | None:
        """The shape of the quantized weight `weight` whose stored tensors `shapes` holds
        (what `stored` was given); None where they do not say. By default a weight is
        stored in its own shape."""
        shape = shapes.get(weight)
        return None if shape is None else tuple(shape)

    def unpacked_shape(
        self, weight: str, shapes: Shapes, packed: str, per: int
    ) -> tuple[int, ...] | None:
        """`weight_shape` of a weight stored `per` values to an element of `packed` along
        its columns, where `stored` gives every stored tensor of that shape."""
        found = shapes.get(packed)
        if found is None or len(found) != 2:
            return None
        shape = (found[0], found[1] * per)
        stored = self.stored(weight, shape)
        if any(tuple(shapes.get(name, ())) != tuple(s) for name, (s, _) in stored.items()):
            return None
        return shape

    def skips(self, layer: str, *parts: str) -> bool:
        """Whether vLLM leaves a layer unquantized; `layer`: vLLM's name of it, `parts`:
        a fused layer's checkpoint names."""
        return False

    def places(self, kind: str) -> bool:
        """Whether shardprep lays out a quantized layer of this kind ("column", "row",
        "replicated", "experts")."""
        return True

    def params(
        self, name: str, pieces: tuple[Piece, ...], shapes: Shapes, tp: int, moe_ways: int
    ) -> QuantParams:
        """The parameters vLLM builds of one quantized parameter `name` made of `pieces`
        (of the unquantized weights, whose shapes `shapes` gives), and the stored tensors
        it loads nowhere."""
        raise NotImplementedError

    def alongside(
        self, pieces: tuple[Piece, ...], shapes: Shapes
    ) -> tuple[tuple[Piece, ...], str | None] | None:
        """A parameter of the model's that is not quantized but cut with the quantized ones
        (MXFP4 expert biases), as its pieces and dtype; None: it keeps its cut."""
        return None

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """vLLM's refusals of one quantized layer at `tp`, in its words."""
        return []

    def derived_cuts(self, source: str, shape: tuple[int, ...], expert: int | None) -> list[Piece]:
        """The cuts in this scheme's own terms that a derived layout tries first for a
        stored tensor of `shape` (an expert's piece of it, for `expert`): a derived piece
        takes one only where it gives vLLM's regions on every rank. None by default."""
        return []

    def derived_dtype(self, cut: Cut) -> str | None:
        """The dtype vLLM holds a parameter of one of `derived_cuts`' cuts in, whatever the
        model's dtype (None: it follows the model's or its source's)."""
        return None

    def for_experts(self, experts: Collection[str]) -> Scheme:
        """The scheme where `experts` are the stored weights of the routed experts vLLM
        stacks, for a scheme that quantizes them otherwise than the linear layers (a
        family names them by its own pattern; a derived layout finds them). Most need not."""
        return self
