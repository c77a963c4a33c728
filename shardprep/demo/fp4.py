"""Real e2m1 encodings of float weights for the tiny quantized models: OCP MXFP4 (e8m0
scales per group of 32) and NVFP4 (e4m3 scales per group of 16 and a global scale)."""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 3-bit e2m1 codes
E4M3_MAX = 448.0


def _e2m1_packed(scaled: torch.Tensor) -> torch.Tensor:
    """Values already scaled into e2m1's range, rounded to the nearest code (sign in bit
    3), two to a byte along the last dimension (the even value in the low nibble)."""
    codes = (scaled.abs().unsqueeze(-1) - torch.tensor(E2M1)).abs().argmin(-1)
    codes = codes | ((scaled < 0).long() << 3)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def nvfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of a float weight [N, K] (K whole groups of 16) as compressed-tensors stores
    it: `weight_packed` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16] and
    `weight_global_scale` float32 [1] (448 * 6 / the largest value); a value is decoded as
    code * scale / global_scale."""
    weight = weight.float()
    global_scale = (E4M3_MAX * 6.0 / weight.abs().amax().clamp_min(1e-12)).reshape(1)
    groups = weight.reshape(weight.shape[0], -1, 16)
    scale = (groups.abs().amax(-1) / 6.0 * global_scale).clamp(2.0**-9, E4M3_MAX)
    scale = scale.to(torch.float8_e4m3fn)
    scaled = groups / (scale.float() / global_scale).unsqueeze(-1)
    packed = _e2m1_packed(scaled.clamp(-6.0, 6.0)).reshape(weight.shape[0], -1)
    return packed, scale, global_scale


def nvfp4_decode(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """The float values of `nvfp4_encode`'s output, [N, K]."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1, 16).long()
    values = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    values = values * (scale.float() / global_scale.float()).unsqueeze(-1)
    return values.reshape(packed.shape[0], -1)


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of a float weight [.., N, K] (K whole groups of 32), as gpt-oss stores it:
    blocks uint8 [.., N, K/32, 16], two e2m1 codes to a byte (sign in bit 3, the even
    value in the low nibble), and scales uint8 [.., N, K/32], e8m0 exponents (bias 127)
    chosen so that each group's largest value is at most 6 (e2m1's largest)."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    packed = _e2m1_packed(groups / torch.exp2(exponent))
    return packed, (exponent.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float values of `mxfp4_encode`'s output, [.., N, K]."""
    codes = torch.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32).long()
    values = torch.tensor(E2M1)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    values = values * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.reshape(*values.shape[:-2], -1)
