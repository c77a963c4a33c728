"""Kimi-K3's quantization as vLLM loads it.

Kimi-K3 is published with its routed experts in compressed-tensors `mxfp4-pack-quantized`
(`x.weight_packed` uint8 [N, K/2], `x.weight_scale` uint8 e8m0 [N, K/32]) and everything
else in bfloat16. vLLM does not load it as compressed-tensors: for Kimi-K3
(`KimiK3ForConditionalGenerationConfig` in `model_executor/models/config.py`) it rewrites
`quant_method` to `mxfp4`, so `Mxfp4Config` builds every routed expert layer with
`Mxfp4MoEMethod` (uint8 `w13_weight`, `w2_weight` and their `_scale`, over the latent
width) and every linear layer unquantized, whatever the `ignore` list says (that config
keeps none). The published ignore list does not name the latent projections
`routed_expert_down_proj`/`up_proj`, which compressed-tensors would quantize; vLLM leaves
them, as the checkpoint stores them, in bfloat16. plan/quant/fp4.py's `Mxfp4PackMoeQuant`
holds the rules of that method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shardprep.plan.quant import Scheme
from shardprep.plan.quant.fp4 import Mxfp4PackMoeQuant, Mxfp4PackQuant

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down of `block_sparse_moe.experts.{e}.`


def quantized_weights(moe_layers: Iterable[int], experts: int, model: str) -> dict[str, str]:
    """{source weight: vLLM layer} of the routed experts of `moe_layers` (`model`: the
    decoder layers' prefix), the only layers vLLM builds quantized."""
    found: dict[str, str] = {}
    for layer in moe_layers:
        stack = f"{model}layers.{layer}.block_sparse_moe.experts"
        for e in range(experts):
            found |= {f"{stack}.{e}.{w}.weight": stack for w in EXPERT_WEIGHTS}
    return found


def quant_scheme(scheme: Scheme) -> Scheme:
    """compressed-tensors MXFP4 as vLLM's MXFP4 interface loads it; others unchanged."""
    if type(scheme) is Mxfp4PackQuant:
        return Mxfp4PackMoeQuant(
            **{f.name: getattr(scheme, f.name) for f in dataclasses.fields(scheme)}
        )
    return scheme
