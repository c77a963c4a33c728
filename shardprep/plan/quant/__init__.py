"""Quantization schemes: how a logical weight becomes its stored tensors (weights, scales)
and how vLLM checks and cuts each of them. A family says which of its weights are
quantized and names the schemes it places (`Family.quant_schemes`); the rules of a scheme
live here, once, whichever family uses it.

One module per scheme (its hooks declared in `base.py`); this table selects the scheme of
a config.json, keyed as vLLM selects its quantization config: by `quant_method`, and for
compressed-tensors by the checkpoint's `format`. A module is imported only when a config
of it is read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from shardprep.errors import ConfigError
from shardprep.plan.quant.base import Example, Scheme
from shardprep.plan.quant.mxfp4 import Mxfp4Quant

__all__ = [
    "Example",
    "Mxfp4Quant",
    "Scheme",
    "all_schemes",
    "never_loaded",
    "param_suffixes",
    "register_scheme",
    "scheme_names",
    "scheme_of",
    "variant_schemes",
]

ANY_FORMAT = "*"
FALLBACK = ("fp8", ANY_FORMAT)  # another quant_method: fp8's reader refuses it by name

# (quant_method, format or ANY_FORMAT) -> (module under shardprep.plan.quant, the function
# that reads `quantization_config` into its scheme, one it cannot lay out with `problem` set)
_TABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("fp8", ANY_FORMAT): ("fp8", "fp8_quant"),
    ("compressed-tensors", "float-quantized"): ("fp8_ct", "float_quant"),
    ("compressed-tensors", "pack-quantized"): ("int4", "pack_quant"),
    ("compressed-tensors", "mxfp4-pack-quantized"): ("fp4", "mxfp4_pack_quant"),
    ("compressed-tensors", "nvfp4-pack-quantized"): ("fp4", "nvfp4_pack_quant"),
    ("compressed-tensors", ANY_FORMAT): ("int4", "pack_quant"),  # refuses the format by name
    ("modelopt", ANY_FORMAT): ("modelopt", "modelopt_quant"),
    ("mxfp4", ANY_FORMAT): ("mxfp4", "mxfp4_quant"),
    ("gpt_oss_mxfp4", ANY_FORMAT): ("mxfp4", "mxfp4_quant"),
}
# Modules of the schemes no config selects by itself: those a family hands vLLM instead of
# a declared one (`Family.quant_scheme`, where the family chooses it).
_VARIANTS: tuple[str, ...] = ("fp8_mxfp4",)


def register_scheme(method: str, format: str, module: str, reader: str) -> None:
    """Add a scheme's reader for (`method`, `format`) (`module` is a full import path for
    one outside shardprep). Registering the same entry again does nothing; another entry
    under a taken key is an error."""
    entry, key = (module, reader), (method, format)
    if _TABLE.get(key, entry) != entry:
        raise ConfigError(f"quantization {key} is registered twice: as {_TABLE[key]} and {entry}")
    _TABLE[key] = entry
    all_schemes.cache_clear()


@cache
def _module(module: str) -> Any:
    return importlib.import_module(module if "." in module else f"{__name__}.{module}")


def _reader(method: str, fmt: str) -> Callable[[Mapping[str, Any]], Scheme]:
    entry = _TABLE.get((method, fmt)) or _TABLE.get((method, ANY_FORMAT)) or _TABLE[FALLBACK]
    return getattr(_module(entry[0]), entry[1])


def _method(quant: Mapping[str, Any]) -> str:
    """`quant_method` as the table keys it: ModelOpt's by its prefix, as vLLM overrides
    `modelopt_fp4`, `modelopt_mixed`... with the checkpoint's algorithm."""
    method = quant.get("quant_method")
    if str(method or "").lower().startswith("modelopt"):
        return "modelopt"
    return method if isinstance(method, str) else ""


def scheme_of(config: Mapping[str, Any], mxfp4_pad: str | None = None) -> Scheme | None:
    """The scheme config.json's `quantization_config` declares; None when unquantized. A
    scheme shardprep cannot lay out comes back with its `problem` set. `mxfp4_pad`: the
    MoE backend's padding of MXFP4 experts (`--mxfp4-pad`; None: the default)."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    fmt = quant.get("format")
    scheme = _reader(_method(quant), fmt if isinstance(fmt, str) else "")(quant)
    return scheme.for_request(mxfp4_pad)


@cache
def all_schemes() -> tuple[type[Scheme], ...]:
    """Every scheme class of the table's modules and of the families' variants."""
    for module in sorted({m for m, _ in _TABLE.values()} | set(_VARIANTS)):
        _module(module)
    found: list[type[Scheme]] = []
    stack = list(Scheme.__subclasses__())
    while stack:
        scheme = stack.pop(0)
        stack += scheme.__subclasses__()
        if "name" in vars(scheme) or "method" in vars(scheme):
            found.append(scheme)
    return tuple(dict.fromkeys(found))


def variant_schemes() -> tuple[type[Scheme], ...]:
    """The scheme classes of the families' variants: those no config selects by itself."""
    modules = {f"{__name__}.{module}" for module in _VARIANTS}
    return tuple(scheme for scheme in all_schemes() if scheme.__module__ in modules)


def scheme_names(method: str) -> frozenset[str]:
    """The schemes whose stored tensors vLLM's quantization `method` loads."""
    return frozenset(scheme.name for scheme in all_schemes() if scheme.method == method)


def param_suffixes() -> tuple[str, ...]:
    """How every scheme's parameters end besides the weight's own name (report.py)."""
    return tuple(sorted({s for scheme in all_schemes() for s in scheme.param_suffixes}))


# What vLLM's quantization configs give every attention layer (`BaseKVCacheMethod`): KV-cache
# scales, left at -1 unless the checkpoint has them (which shardprep's plans never do).
KV_CACHE_SCALES: tuple[str, ...] = (
    ".attn.k_scale",
    ".attn.v_scale",
    ".attn.q_scale",
    ".attn.prob_scale",
)
# ... and compressed-tensors' zero points beside them (`CompressedTensorsKVCacheMethod`).
KV_CACHE_SCALES += (".attn.k_zero_point", ".attn.v_zero_point", ".attn.q_zero_point")


def never_loaded(parameter: str) -> bool:
    """Whether vLLM creates `parameter` for a quantized model but loads nothing into it."""
    return parameter.endswith(KV_CACHE_SCALES)
