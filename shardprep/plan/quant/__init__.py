"""Quantization schemes: how a logical weight becomes its stored tensors (weights, scales)
and how vLLM checks and cuts each of them. A family says which of its weights are
quantized and names the schemes it places (`Family.quant_schemes`); the rules of a scheme
live here, once, whichever family uses it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from shardprep.plan.quant.fp4 import FORMAT as MXFP4_PACK
from shardprep.plan.quant.fp4 import NV_FORMAT as NVFP4_PACK
from shardprep.plan.quant.fp4 import (
    Mxfp4PackMoeQuant,
    Mxfp4PackQuant,
    Nvfp4PackQuant,
    mxfp4_pack_quant,
    nvfp4_pack_quant,
)
from shardprep.plan.quant.fp8 import BlockQuant, block_quant
from shardprep.plan.quant.fp8_ct import FloatQuant, float_quant
from shardprep.plan.quant.fp8_mxfp4 import Fp8Mxfp4Quant
from shardprep.plan.quant.fp8_tensor import TensorQuant
from shardprep.plan.quant.int4 import PackQuant, pack_quant
from shardprep.plan.quant.modelopt import ModeloptNvfp4, is_modelopt, modelopt_quant
from shardprep.plan.quant.mxfp4 import Mxfp4Pad, Mxfp4Quant, mxfp4_quant

# Each scheme says what a quantized weight is stored as (`stored`, `logical`), which layers
# vLLM leaves unquantized (`skips`), the parameters vLLM builds of a quantized parameter
# and how each is cut (`params`), which layers shardprep lays out (`places`) and what vLLM
# refuses at a tp (`refusals`).
Scheme = (
    BlockQuant
    | TensorQuant
    | FloatQuant
    | PackQuant
    | Mxfp4PackQuant
    | Mxfp4PackMoeQuant
    | Nvfp4PackQuant
    | Mxfp4Quant
    | ModeloptNvfp4
)
# Every scheme, with those a family substitutes for one of these (`Family.quant_scheme`).
SCHEMES = (*typing.get_args(Scheme), Fp8Mxfp4Quant)


def scheme_names(method: str) -> frozenset[str]:
    """The schemes whose stored tensors vLLM's quantization `method` loads."""
    return frozenset(scheme.name for scheme in SCHEMES if scheme.method == method)


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


def scheme_of(config: Mapping[str, Any], mxfp4_pad: str | None = None) -> Scheme | None:
    """The scheme config.json's `quantization_config` declares; None when unquantized. A
    scheme shardprep cannot lay out comes back with its `problem` set. `mxfp4_pad`: the
    MoE backend's padding of MXFP4 experts (`--mxfp4-pad`; None: the default)."""
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") == PackQuant.method:
        if quant.get("format") == MXFP4_PACK:
            return mxfp4_pack_quant(quant)
        if quant.get("format") == "float-quantized":
            return float_quant(quant)
        if quant.get("format") == NVFP4_PACK:
            return nvfp4_pack_quant(quant)
        return pack_quant(quant)
    if quant and is_modelopt(quant):
        return modelopt_quant(quant)
    if quant and quant.get("quant_method") in ("mxfp4", "gpt_oss_mxfp4"):
        return dataclasses.replace(mxfp4_quant(quant), pad=Mxfp4Pad.parse(mxfp4_pad))
    return block_quant(config)
