"""Test-only: a stand-in for the sparse attention backend vLLM's CPU build cannot choose.

DeepSeek-V3.2's attention layers are sparse MLA (`use_sparse`), and the CPU platform
refuses to pick a backend for them (`CpuPlatform.get_attn_backend_cls` raises "Sparse
Attention is not supported on CPU."), so the model cannot even be built. The layout does
not depend on the backend: the parameters and weight loaders are the model's own. With
``$SHARDPREP_STUB_SPARSE_ATTENTION=1``, ``install`` wraps the platform's choice: the
original runs first, and only when it raises for a sparse layer is the CPU MLA backend
named instead. The model then builds and loads; it cannot compute sparse attention, so
the engine fails after loading (runs that dump the state allow that).

Without the variable nothing is changed.
"""

from __future__ import annotations

import functools
import os
from typing import Any

STUB_SPARSE_ENV = "SHARDPREP_STUB_SPARSE_ATTENTION"
WRAPPED = "_shardprep_stubbed"


def install() -> bool:
    """Put the stand-in in place when ``$SHARDPREP_STUB_SPARSE_ATTENTION=1``; whether it did."""
    if os.environ.get(STUB_SPARSE_ENV) != "1":
        return False
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls.__func__  # type: ignore[attr-defined]
    if getattr(original, WRAPPED, False):
        return True

    @functools.wraps(original)
    def choose(
        cls: Any, selected_backend: Any, attn_selector_config: Any, *args: Any, **kw: Any
    ) -> str:
        try:
            return original(cls, selected_backend, attn_selector_config, *args, **kw)
        except NotImplementedError:
            if not attn_selector_config.use_sparse:
                raise
            return AttentionBackendEnum.CPU_MLA.get_path()

    setattr(choose, WRAPPED, True)
    CpuPlatform.get_attn_backend_cls = classmethod(choose)  # type: ignore[method-assign]
    return True
