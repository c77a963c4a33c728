"""The stored tensors of the tiny quantized models: real encodings where a scheme has
one (MXFP4, NVFP4), plausible random values elsewhere."""

from __future__ import annotations

import torch

from shardprep.demo.fp4 import mxfp4_encode, nvfp4_encode


def quantized_tensors(
    tensors: dict[str, torch.Tensor],
    dtypes: dict[str, str],
    plain: dict[str, tuple[int, ...]],
    seed: int,
) -> dict[str, torch.Tensor]:
    """fp8 weights of unit scale (clamped), small positive float32 scales, random
    packed int4 values with each weight's true [N, K] beside them, random weights encoded
    in MXFP4 or NVFP4 (compressed-tensors' or ModelOpt's), and other tensors that the
    checkpoint keeps in float32."""
    generator = torch.Generator().manual_seed(seed + 1)
    changed = {}
    for name, dtype in sorted(dtypes.items()):
        shape = tensors[name].shape
        if name.endswith(".weight_scale_2"):  # a random weight in ModelOpt's NVFP4
            stem = name.removesuffix("weight_scale_2")
            rows, half = tensors[stem + "weight"].shape
            weight = 0.05 * torch.randn(rows, 2 * half, generator=generator)
            packed, scale, global_scale = nvfp4_encode(weight)
            changed[stem + "weight"], changed[stem + "weight_scale"] = packed, scale
            changed[name] = (1.0 / global_scale).reshape(())  # amax / (6 * 448)
            inputs = 100.0 + 400.0 * torch.rand((), generator=generator)
            changed[stem + "input_scale"] = 1.0 / inputs
        elif stem_of(name) + "weight_scale_2" in dtypes:
            pass  # written with its weight_scale_2
        elif name.endswith("weight_global_scale"):  # a random weight encoded in NVFP4
            stem = name.removesuffix("global_scale")
            rows, half = tensors[stem + "packed"].shape
            weight = 0.05 * torch.randn(rows, 2 * half, generator=generator)
            packed, scale, changed[name] = nvfp4_encode(weight)
            changed[stem + "packed"], changed[stem + "scale"] = packed, scale
        elif name.endswith("input_global_scale"):
            changed[name] = 100.0 + 400.0 * torch.rand((1,), generator=generator)
        elif stem_of(name) + "weight_global_scale" in dtypes:
            pass  # written with its global scale
        elif dtype == "I8" and stem_of(name) + "scale" in dtypes:  # DeepSeek-V4's MXFP4
            rows, half = shape  # a random weight [N, K] encoded, [N, K/2] and [N, K/32]
            weight = 0.05 * torch.randn(rows, 2 * half, generator=generator)
            blocks, scales = mxfp4_encode(weight)
            changed[name] = blocks.reshape(rows, half).view(torch.int8)
            changed[stem_of(name) + "scale"] = scales.view(torch.float8_e8m0fnu)
        elif dtype == "F8_E8M0" and dtypes.get(stem_of(name) + "weight") == "I8":
            pass  # written with its weight
        elif dtype == "F8_E8M0":  # fp8 block scales as e8m0 exponents (2^-8 .. 2^-1)
            values = torch.randint(119, 127, tuple(shape), generator=generator)
            changed[name] = values.to(torch.uint8).view(torch.float8_e8m0fnu)
        elif dtype == "F8_E4M3":
            values = torch.randn(shape, generator=generator).clamp(-4, 4)
            changed[name] = values.to(torch.float8_e4m3fn)
        elif name.endswith(".weight_shape"):
            changed[name] = torch.tensor(plain[name.removesuffix("_shape")], dtype=torch.int32)
        elif dtype == "I32":
            values = torch.randint(-(2**31), 2**31 - 1, tuple(shape), generator=generator)
            changed[name] = values.to(torch.int32)
        elif name.endswith("weight_packed") and dtype == "U8":  # two e2m1 codes a byte
            values = torch.randint(0, 256, tuple(shape), generator=generator)
            changed[name] = values.to(torch.uint8)
        elif name.endswith("weight_scale") and dtype == "U8":  # e8m0 exponents
            values = torch.randint(119, 127, tuple(shape), generator=generator)
            changed[name] = values.to(torch.uint8)
        elif name.endswith("_blocks"):  # a random weight [.., N, K] encoded in MXFP4
            *lead, rows, groups, _ = shape
            weight = 0.05 * torch.randn(*lead, rows, groups * 32, generator=generator)
            blocks, scales = mxfp4_encode(weight)
            changed[name] = blocks
            changed[name.removesuffix("_blocks") + "_scales"] = scales
        elif name.endswith("_scales"):
            pass  # written with its blocks
        elif name.endswith(("weight_scale_inv", ".weight_scale", ".input_scale")):
            changed[name] = 0.01 + 0.02 * torch.rand(shape, generator=generator)
        else:
            changed[name] = tensors[name].float()
    return changed


def stem_of(name: str) -> str:
    """`x.` of a quantized weight's stored tensor `x.weight_packed`, `x.weight_scale`..."""
    return name.rsplit(".", 1)[0] + "."
