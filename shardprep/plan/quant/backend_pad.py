"""Expert stacks whose shape the MoE kernel backend chooses: where a stored stack goes in
the parameter the running backend's `create_weights` built.

vLLM's MXFP4 MoE methods round each rank's intermediate size and the hidden size up to
the backend's alignment (`mxfp4_round_up_hidden_size_and_intermediate_size`: 128 and 256
for Marlin and TRT-LLM, 128 and 128 for CUTLASS and DeepGEMM, 32 for emulation and the
CPU, 64 for the Triton kernels, none for some FlashInfer paths), build zero parameters of
that size and copy the checkpoint's values into their front. The padding is zeros, so an
artifact stores the stacks unpadded and the loader places them in whatever the backend
built. Where the values go depends on how the method's weight loader fills them:

- gpt-oss's `GptOssMxfp4MoEMethod` (loaded whole by `_load_weights_mxfp4`): the rank's
  values in the corner of every dimension (gate and up rows interleaved, padded at the end);
- FusedMoE's own loader (`Mxfp4MoEMethod`: Kimi-K3's and DeepSeek-V4's MXFP4 experts):
  `w13_*` holds gate then up, each half padded at its end (`_load_w13` narrows the
  parameter to its half first), the other dimensions in the corner.

Pure arithmetic on shapes: the loader applies the spans with torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# Each dimension's (start, end) of the destination and of the stored tensor.
Span = tuple[int, int]
Placement = tuple[tuple[Span, ...], tuple[Span, ...]]

# FusedMoE's expert stacks, by the last part of their parameter name.
W13 = ("w13_weight", "w13_weight_scale", "w13_bias")
W2 = ("w2_weight", "w2_weight_scale", "w2_bias")


@dataclass(frozen=True)
class StackPad:
    """How a stored expert stack sits in a parameter the backend padded: in the corner,
    or (`halves`, a dimension) with that dimension's two halves padded each at its end."""

    halves: int | None = None


CORNER = StackPad()
GATE_UP = StackPad(halves=1)  # [experts, 2 * intermediate, ...]: gate half, then up half

# vLLM's quantization method -> (the stacks, how each is padded).
_BY_METHOD: dict[str, tuple[tuple[tuple[str, ...], StackPad], ...]] = {
    "gpt_oss_mxfp4": ((W13 + W2, CORNER),),
    "mxfp4": ((W13, GATE_UP), (W2, CORNER)),  # Kimi-K3's experts, as vLLM rewrites them
    "deepseek_v4_fp8": ((W13, GATE_UP), (W2, CORNER)),  # DeepSeek-V4's MXFP4 experts
}


def stack_pad(method: str | None, name: str) -> StackPad | None:
    """How parameter `name` of a model that vLLM quantizes with `method` may be padded by
    the MoE backend; None: never (its shape must equal the stored one)."""
    last = name.rpartition(".")[2]
    for stacks, pad in _BY_METHOD.get(method or "", ()):
        if last in stacks:
            return pad
    return None


def pads_by_backend(method: str | None) -> bool:
    """Whether the MoE backend of `method` chooses the shape of some expert stacks."""
    return (method or "") in _BY_METHOD


def placements(
    stored: tuple[int, ...], built: tuple[int, ...], pad: StackPad
) -> tuple[Placement, ...] | None:
    """The spans that copy a stored stack into a parameter of shape `built` padded as
    `pad` says (the rest of the parameter is zero); None when it does not fit: another
    number of dimensions, a dimension longer than the parameter's, or halves of odd size."""
    if len(stored) != len(built) or any(s > b for s, b in zip(stored, built, strict=True)):
        return None
    corner = tuple((0, s) for s in stored)
    dim = pad.halves
    if dim is None or dim >= len(stored) or stored[dim] == built[dim]:
        return ((corner, corner),)
    if stored[dim] % 2 or built[dim] % 2:
        return None
    half, room = stored[dim] // 2, built[dim] // 2
    out = []
    for part in range(2):
        dest = (*corner[:dim], (part * room, part * room + half), *corner[dim + 1 :])
        source = (*corner[:dim], (part * half, (part + 1) * half), *corner[dim + 1 :])
        out.append((dest, source))
    return tuple(out)
