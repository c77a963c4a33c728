"""The stored tensors of the tiny quantized models, as each scheme declares them
(`Scheme.examples`): real encodings where a scheme has one (MXFP4, NVFP4), plausible
random values elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from shardprep.demo.fp4 import mxfp4_encode, nvfp4_encode
from shardprep.format.dtypes import torch_dtype
from shardprep.plan.quant import base
from shardprep.plan.quant.base import Example

# (the example, each tensor it writes as (shape, safetensors dtype), the generator) -> them
Maker = Callable[[Example, list[tuple[tuple[int, ...], str]], torch.Generator], list[torch.Tensor]]


def quantized_tensors(
    tensors: dict[str, torch.Tensor],
    dtypes: dict[str, str],
    examples: Mapping[str, Example],
    seed: int,
) -> dict[str, torch.Tensor]:
    """Each tensor of a fixed dtype (`dtypes`) as its scheme's `examples` say, or, for a
    family's own (a float32 routing bias, an int32 table), random int32 or float32 values,
    in the order of their names."""
    generator = torch.Generator().manual_seed(seed + 1)
    written = {other for example in examples.values() for other in example.writes}
    changed: dict[str, torch.Tensor] = {}
    for name, dtype in sorted(dtypes.items()):
        example = examples.get(name)
        if name in written:
            continue
        if example is None:
            changed[name] = _own(tensors[name], dtype, generator)
            continue
        names = (name, *example.writes)
        specs = [(tuple(tensors[n].shape), dtypes[n]) for n in names]
        changed |= dict(zip(names, MAKERS[example.kind](example, specs, generator), strict=True))
    return changed


def _own(tensor: torch.Tensor, dtype: str, generator: torch.Generator) -> torch.Tensor:
    if dtype == "I32":
        values = torch.randint(-(2**31), 2**31 - 1, tuple(tensor.shape), generator=generator)
        return values.to(torch.int32)
    return tensor.float()


def _fp8(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    ((shape, _),) = specs
    return [torch.randn(shape, generator=generator).clamp(-4, 4).to(torch.float8_e4m3fn)]


def _scale(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    ((shape, _),) = specs
    return [0.01 + 0.02 * torch.rand(shape, generator=generator)]


def _exponents(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    ((shape, dtype),) = specs
    values = torch.randint(119, 127, shape, generator=generator).to(torch.uint8)
    return [values.view(torch_dtype(torch, dtype))]


def _bytes(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    ((shape, _),) = specs
    return [torch.randint(0, 256, shape, generator=generator).to(torch.uint8)]


def _int32(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    ((shape, _),) = specs
    return [torch.randint(-(2**31), 2**31 - 1, shape, generator=generator).to(torch.int32)]


def _shape(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.tensor(example.weight, dtype=torch.int32)]


def _activation(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    ((shape, _),) = specs
    return [100.0 + 400.0 * torch.rand(shape, generator=generator)]


def _weight(example: Example, generator: torch.Generator) -> torch.Tensor:
    return 0.05 * torch.randn(*example.weight, generator=generator)


def _mxfp4(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    """The blocks and scales, each in the shape and dtype the scheme stores them in."""
    encoded = mxfp4_encode(_weight(example, generator))
    return [
        t.reshape(shape).view(torch_dtype(torch, d))
        for t, (shape, d) in zip(encoded, specs, strict=True)
    ]


def _nvfp4(example: Example, specs: list, generator: torch.Generator) -> list[torch.Tensor]:
    packed, scale, global_scale = nvfp4_encode(_weight(example, generator))
    return [global_scale, packed, scale]


def _nvfp4_modelopt(
    example: Example, specs: list, generator: torch.Generator
) -> list[torch.Tensor]:
    """`weight_scale_2` (amax / (6 * 448)), the packed weight, its group scales, and the
    inverse of an activation's global scale (`input_scale`)."""
    packed, scale, global_scale = nvfp4_encode(_weight(example, generator))
    inputs = 100.0 + 400.0 * torch.rand((), generator=generator)
    return [(1.0 / global_scale).reshape(()), packed, scale, 1.0 / inputs]


MAKERS: dict[str, Maker] = {
    base.FP8_VALUES: _fp8,
    base.SCALE: _scale,
    base.EXPONENTS: _exponents,
    base.BYTES: _bytes,
    base.INT32: _int32,
    base.SHAPE: _shape,
    base.ACTIVATION: _activation,
    base.MXFP4: _mxfp4,
    base.NVFP4: _nvfp4,
    base.NVFP4_MODELOPT: _nvfp4_modelopt,
}
