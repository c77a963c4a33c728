"""Runs in the deriving child only: vLLM's choices of a kernel or an attention backend,
which a build without the hardware refuses, answered with a stand-in.

The layout does not depend on them: `create_weights` and the weight loaders make and
fill the same parameters whichever kernel later runs the matmul, and the child never
runs one (nor the post-processing that repacks weights for a kernel). Each choice is
wrapped so that vLLM's own runs first and the stand-in is used only where it raises:
where vLLM finds a kernel, its choice stands.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

WRAPPED = "_shardprep_stand_in"


class NoKernel:
    """A kernel that is chosen but never run: the child only loads weights."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def process_weights_after_loading(self, layer: Any) -> None:
        pass

    def input_quant_key(self) -> None:
        """No input quantization to fuse with the layer before it."""
        return None


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


def no_moe_backend(*args: Any, **kwargs: Any) -> tuple[Any, None]:
    """An fp8 MoE with no backend: its weights are created and loaded all the same."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    return Fp8MoeBackend.NONE, None


def int4_experts(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """The CPU build's int4 MoE backend, which computes only with AMX."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    return WNA16MoEBackend.CPU, CPUExpertsInt4


def nvfp4_experts(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """vLLM's NVFP4 MoE emulation (Triton, which a CPU build lacks)."""
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    return NvFp4MoeBackend.EMULATION, Nvfp4QuantizationEmulationTritonExperts


def cpu_mxfp4_experts(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """The CPU build's MXFP4 MoE backend (it computes only with AMX), whose parameters are
    padded the least: to whole 32-blocks, as MXFP4 stores them anyway."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    return Mxfp4MoeBackend.CPU, CPUExpertsMxfp4


def mxfp4_emulation(*args: Any, **kwargs: Any) -> tuple[Any, type]:
    """vLLM's MXFP4 MoE emulation backend, the one `Mxfp4MoEMethod` falls back to (it
    computes only with Triton or AMD Quark), whose parameters are padded the least: to
    whole 32-blocks, as MXFP4 stores them anyway."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        backend_to_kernel_cls,
    )

    return Mxfp4MoeBackend.EMULATION, backend_to_kernel_cls(Mxfp4MoeBackend.EMULATION)[0]


def _compressed_tensors() -> None:
    """compressed-tensors int4 and NVFP4 experts, NVFP4 and fp8 linear layers."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as nvfp4_linear,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as fp8_linear,
    )

    wna16.select_wna16_moe_backend = or_stand_in(wna16.select_wna16_moe_backend, int4_experts)
    nvfp4.select_nvfp4_moe_backend = or_stand_in(nvfp4.select_nvfp4_moe_backend, nvfp4_experts)
    nvfp4_linear.init_nvfp4_linear_kernel = or_stand_in(
        nvfp4_linear.init_nvfp4_linear_kernel, NoKernel
    )
    fp8_linear.init_fp8_linear_kernel = or_stand_in(fp8_linear.init_fp8_linear_kernel, NoKernel)


def install() -> None:
    """Stand-ins for the choices the layout does not depend on."""
    from vllm.model_executor.layers.quantization import fp8, mxfp4

    fp8.init_fp8_linear_kernel = or_stand_in(fp8.init_fp8_linear_kernel, NoKernel)
    fp8.select_fp8_moe_backend = or_stand_in(fp8.select_fp8_moe_backend, no_moe_backend)
    mxfp4.select_mxfp4_moe_backend = or_stand_in(mxfp4.select_mxfp4_moe_backend, cpu_mxfp4_experts)
    mxfp4.select_deepseek_v4_mxfp4_moe_backend = or_stand_in(
        mxfp4.select_deepseek_v4_mxfp4_moe_backend, mxfp4_emulation
    )
    _compressed_tensors()
    _modelopt()
    _sparse_attention()


def _modelopt() -> None:
    """ModelOpt's NVFP4 linear layers and experts."""
    from vllm.model_executor.layers.quantization import modelopt

    modelopt.init_nvfp4_linear_kernel = or_stand_in(modelopt.init_nvfp4_linear_kernel, NoKernel)
    modelopt.select_nvfp4_moe_backend = or_stand_in(
        modelopt.select_nvfp4_moe_backend, nvfp4_experts
    )


def _sparse_attention() -> None:
    """Sparse MLA layers (DeepSeek-V3.2) get the MLA backend where the platform has no
    sparse one: the backend holds no weights."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform = type(current_platform)
    original = platform.get_attn_backend_cls.__func__  # type: ignore[attr-defined]
    if getattr(original, WRAPPED, False):
        return

    @functools.wraps(original)
    def choose(cls: Any, *args: Any, **kwargs: Any) -> str:
        try:
            return original(cls, *args, **kwargs)
        except NotImplementedError:
            selector = kwargs.get("attn_selector_config", args[1] if len(args) > 1 else None)
            if not getattr(selector, "use_sparse", False):
                raise
            return AttentionBackendEnum.CPU_MLA.get_path()

    setattr(choose, WRAPPED, True)
    platform.get_attn_backend_cls = classmethod(choose)  # type: ignore[method-assign,assignment]
