"""Test-only: stand-ins for the quantized kernels vLLM's CPU build cannot choose.

A layout is fixed by vLLM's `create_weights` and weight loaders, not by the matmul
kernel, but vLLM refuses to build an fp8 (or int4, fp4) layer when no kernel can run it
(without AMX the CPU build has none). With ``$SHARDPREP_STUB_KERNELS=1``, ``install``
wraps the kernel-selection functions as the quantization modules import them: the
original runs first, and only when it raises does a stand-in take its place. The
parameters and weight loaders stay vLLM's own, so the state after ``load_weights`` is
the reference a rank file must equal.

The fp8 linear stand-in can even compute: it dequantizes the weight over its blocks and
calls ``F.linear``. MoE stand-ins cannot; with ``$SHARDPREP_SKIP_POSTPROCESS=1`` vLLM's
``process_weights_after_loading`` does nothing, so that the engine goes on to build a
draft after a target whose post-processing would have stopped it.

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
SKIP_POSTPROCESS_ENV = "SHARDPREP_SKIP_POSTPROCESS"
WRAPPED = "_shardprep_stubbed"


class DequantizingFp8Linear:
    """An fp8 linear kernel that vLLM's CPU build lacks: the weight times its scales
    (per block, per channel or per tensor), then an ordinary linear layer."""

    def __init__(self, **config: Any) -> None:
        self.config = config

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, dequantized(layer).to(x.dtype), bias)


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    weight = layer.weight.to(torch.float32)
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is None:
        scale = layer.weight_scale
    scale = scale.to(torch.float32)
    if scale.dim() == 2 and scale.shape != weight.shape:  # one scale per block
        rows = -(-weight.shape[0] // scale.shape[0])
        cols = -(-weight.shape[1] // scale.shape[1])
        scale = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        scale = scale[: weight.shape[0], : weight.shape[1]]
    elif scale.dim() == 1 and scale.numel() == weight.shape[0]:
        scale = scale[:, None]
    return weight * scale


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
    if os.environ.get(STUB_ENV) != "1":
        return False
    from vllm.model_executor.layers.quantization import fp8

    fp8.init_fp8_linear_kernel = or_stand_in(
        fp8.init_fp8_linear_kernel, lambda **config: DequantizingFp8Linear(**config)
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )

    wna16.select_wna16_moe_backend = or_stand_in(wna16.select_wna16_moe_backend, cpu_int4_experts)
    from vllm.model_executor.layers.quantization import mxfp4

    mxfp4.select_mxfp4_moe_backend = or_stand_in(mxfp4.select_mxfp4_moe_backend, cpu_mxfp4_experts)
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4,
    )

    nvfp4.select_nvfp4_moe_backend = or_stand_in(nvfp4.select_nvfp4_moe_backend, nvfp4_emulation)
    return True


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


def nvfp4_emulation(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """vLLM's NVFP4 MoE emulation backend (Triton, which the CPU build lacks): its class
    need only exist to build the layer."""
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    return NvFp4MoeBackend.EMULATION, Nvfp4QuantizationEmulationTritonExperts
