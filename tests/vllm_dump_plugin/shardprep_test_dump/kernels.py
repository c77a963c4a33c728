"""Test-only: stand-ins for the quantized kernels vLLM's CPU build cannot choose.

A layout is fixed by vLLM's `create_weights` and weight loaders, not by the matmul
kernel, but vLLM refuses to build an fp8 (or int4, fp4) layer when no kernel can run it
(without AMX the CPU build has none). With ``$SHARDPREP_STUB_KERNELS=1``, ``install``
wraps the kernel-selection functions as the quantization modules import them: the
original runs first, and only when it raises does a stand-in take its place. The
parameters and weight loaders stay vLLM's own, so the state after ``load_weights`` is
the reference a rank file must equal.

The fp8 linear stand-in can even compute: it dequantizes the weight over its blocks (or
with its per-tensor or per-channel scales) and calls ``F.linear``; the requantization of
per-tensor post-processing gets a plain torch stand-in too. MoE stand-ins cannot; with
``$SHARDPREP_SKIP_POSTPROCESS=1`` vLLM's ``process_weights_after_loading`` does nothing,
so that the engine goes on to build a draft after a target whose post-processing would
have stopped it.

With ``$SHARDPREP_MXFP4_BACKENDS`` (names of vLLM's `Mxfp4MoeBackend`, comma-separated),
the MXFP4 MoE backend choice itself is replaced: the MoE layers a process builds take
those backends in turn (layer i the (i mod n)-th), whatever the device could run, so that
`create_weights` sizes every stack as that backend pads it. Only the choice is replaced;
the experts class need only exist (nothing runs it before post-processing).

Without the variables nothing is changed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

STUB_ENV = "SHARDPREP_STUB_KERNELS"
MXFP4_BACKENDS_ENV = "SHARDPREP_MXFP4_BACKENDS"
SKIP_POSTPROCESS_ENV = "SHARDPREP_SKIP_POSTPROCESS"
WRAPPED = "_shardprep_stubbed"


class DequantizingFp8Linear:
    """An fp8 linear kernel that vLLM's CPU build lacks: the weight times its scales
    (per block, per channel or per tensor), then an ordinary linear layer."""

    def __init__(self, **config: Any) -> None:
        self.config = config
        self.transposed = False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # vLLM's per-tensor and per-channel post-processing hands the kernel the weight
        # as [K, N] (and one scale for a fused layer's parts); its block path keeps [N, K].
        group = self.config["weight_quant_key"].scale.group_shape
        self.transposed = group.is_per_tensor() or group.is_per_channel()

    def input_quant_key(self) -> None:
        """The stand-in quantizes no input (compressed-tensors asks)."""
        return None

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = dequantized(layer, self.transposed)
        return F.linear(x, weight.to(x.dtype), bias)


def dequantized(layer: torch.nn.Module, transposed: bool = False) -> torch.Tensor:
    weight = layer.weight.to(torch.float32)
    if transposed:
        weight = weight.t()
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is None:
        scale = layer.weight_scale
    scale = scale.to(torch.float32)
    widths = getattr(layer, "logical_widths", None) or []
    if scale.dim() == 2 and scale.shape[1] == 1:  # one scale per output channel
        scale = scale.reshape(-1)
    if scale.dim() == 1 and 1 < scale.numel() == len(widths) != weight.shape[0]:
        # one scale per part of a fused layer, as loaded
        scale = scale.repeat_interleave(torch.tensor(widths, device=scale.device))
    if scale.dim() == 2 and scale.shape != weight.shape:  # one scale per block
        rows = -(-weight.shape[0] // scale.shape[0])
        cols = -(-weight.shape[1] // scale.shape[1])
        scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        scale = scale[: weight.shape[0], : weight.shape[1]]
    elif scale.dim() == 1 and scale.numel() == weight.shape[0]:
        scale = scale[:, None]
    return weight * scale


def static_fp8_quant(
    input: torch.Tensor, scale: torch.Tensor | None = None, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.scaled_fp8_quant` with a static scale, which the CPU build lacks."""
    if scale is None:
        raise NotImplementedError("the stand-in quantizes with a static scale only")
    finfo = torch.finfo(torch.float8_e4m3fn)
    values = (input.to(torch.float32) / scale.to(torch.float32)).clamp(finfo.min, finfo.max)
    return values.to(torch.float8_e4m3fn), scale


def or_stand_in(original: Callable[..., Any], stand_in: Callable[..., Any]) -> Callable[..., Any]:
    """`original`, and `stand_in` with the same arguments where `original` raises."""
    if getattr(original, WRAPPED, False):
        return original

    @functools.wraps(original)
    def choose(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception:
            return stand_in(*args, **kwargs)

    setattr(choose, WRAPPED, True)
    return choose


def install() -> bool:
    """Put the stand-ins in place when ``$SHARDPREP_STUB_KERNELS=1``; whether it did."""
    if os.environ.get(SKIP_POSTPROCESS_ENV) == "1":
        from vllm.model_executor.model_loader import base_loader

        base_loader.process_weights_after_loading = lambda *args, **kwargs: None
    if os.environ.get(MXFP4_BACKENDS_ENV):
        force_mxfp4_backends(os.environ[MXFP4_BACKENDS_ENV].split(","))
    if os.environ.get(STUB_ENV) != "1":
        return False
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as ct_fp8,
    )

    for module in (fp8, ct_fp8):
        module.init_fp8_linear_kernel = or_stand_in(
            module.init_fp8_linear_kernel, lambda **config: DequantizingFp8Linear(**config)
        )
    from vllm import _custom_ops

    # The per-tensor post-processing requantizes a fused layer's parts to one scale.
    _custom_ops.scaled_fp8_quant = or_stand_in(_custom_ops.scaled_fp8_quant, static_fp8_quant)
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )

    wna16.select_wna16_moe_backend = or_stand_in(wna16.select_wna16_moe_backend, cpu_int4_experts)
    from vllm.model_executor.layers.quantization import mxfp4

    mxfp4.select_mxfp4_moe_backend = or_stand_in(mxfp4.select_mxfp4_moe_backend, cpu_mxfp4_experts)
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = or_stand_in(
        mxfp4.select_deepseek_v4_mxfp4_moe_backend, mxfp4_emulation
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4,
    )

    nvfp4.select_nvfp4_moe_backend = or_stand_in(nvfp4.select_nvfp4_moe_backend, nvfp4_emulation)
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as ct_nvfp4,
    )

    for module in (ct_nvfp4, modelopt):
        module.init_nvfp4_linear_kernel = or_stand_in(
            module.init_nvfp4_linear_kernel, nvfp4_linear_emulation
        )
    modelopt.select_nvfp4_moe_backend = or_stand_in(
        modelopt.select_nvfp4_moe_backend, nvfp4_emulation
    )
    return True


def nvfp4_linear_emulation(use_a16: bool = False) -> Any:
    """vLLM's own NVFP4 linear emulation (plain torch off CUDA), which it registers for
    CUDA and ROCm only; weight-only (NVFP4A16) layers get the same weight decoding without
    the input quantization."""
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

    kind = WeightOnlyNvfp4Emulation if use_a16 else EmulationNvFp4LinearKernel
    return kind(NvFp4LinearLayerConfig())


class WeightOnlyNvfp4Emulation:
    """Decodes the NVFP4 weight as vLLM's emulation does, then an ordinary linear layer."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def input_quant_key(self) -> None:
        return None

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
            dequantize_to_dtype,
        )

        weight = dequantize_to_dtype(
            layer.weight.data.view(torch.uint8), layer.weight_scale.data,
            layer.weight_global_scale, x.dtype, 16, swizzle=False,
        )  # fmt: skip
        return F.linear(x, weight, bias)


def cpu_int4_experts(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """The WNA16 MoE backend of the CPU build, which needs AMX to compute: its experts
    class only has to exist for vLLM to build the layer (nothing runs it before
    `process_weights_after_loading`, which a state-only run sets aside)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    return WNA16MoEBackend.CPU, CPUExpertsInt4


def cpu_mxfp4_experts(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """The MXFP4 MoE backend of the CPU build (AMX only): its class need only exist to
    build the layer, whose parameters it pads to 32."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    return Mxfp4MoeBackend.CPU, CPUExpertsMxfp4


def mxfp4_emulation(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """vLLM's MXFP4 MoE emulation backend (`Mxfp4MoEMethod`'s, as Kimi-K3 and DeepSeek-V4
    use; it needs Triton or AMD Quark to compute): its class need only exist to build the
    layer, whose stacks it pads to 32."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        backend_to_kernel_cls,
    )

    return Mxfp4MoeBackend.EMULATION, backend_to_kernel_cls(Mxfp4MoeBackend.EMULATION)[0]


def nvfp4_emulation(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """vLLM's NVFP4 MoE emulation backend (Triton, which the CPU build lacks): its class
    need only exist to build the layer."""
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    return NvFp4MoeBackend.EMULATION, Nvfp4QuantizationEmulationTritonExperts


def force_mxfp4_backends(names: list[str]) -> None:
    """Every MXFP4 MoE layer built from now on takes the next of `names` as its backend
    (gpt-oss's `select_mxfp4_moe_backend` and `Mxfp4MoEMethod`'s
    `select_deepseek_v4_mxfp4_moe_backend` alike)."""
    import itertools

    from vllm.model_executor.layers.quantization import mxfp4

    if getattr(mxfp4.select_mxfp4_moe_backend, FORCED, False):
        return
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    backends = [Mxfp4MoeBackend[name] for name in names]
    turn = itertools.count()

    def forced(*args: Any, **kwargs: Any) -> tuple[Any, type | None]:
        backend = backends[next(turn) % len(backends)]
        return backend, experts_class(backend)

    setattr(forced, FORCED, True)
    mxfp4.select_mxfp4_moe_backend = forced
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = forced


FORCED = "_shardprep_forced"


def experts_class(backend: Any) -> type | None:
    """The backend's experts class where this build can import it; None otherwise (vLLM
    only uses it in post-processing)."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import backend_to_kernel_cls

    try:
        return backend_to_kernel_cls(backend)[0]
    except Exception:
        return None
