"""DeepSeek-V4's quantization as vLLM loads it (`models/deepseek_v4/quant_config.py`,
`DeepseekV4FP8Config`, chosen for `quant_method: fp8` of a `deepseek_v4` model).

With `expert_dtype: fp4` (DeepSeek-V4-Flash as published) every linear layer vLLM builds
with the model's quantization is fp8 in blocks with e8m0 scales, and the routed experts are
MXFP4 (`Mxfp4MoEMethod`): plan/quant/fp8_mxfp4.py's `Fp8Mxfp4Quant`. The layers built with
it: the attention's `fused_wqa_wkv` (`wq_a`, `wkv`), `wq_b`, `wo_a`, `wo_b`, the indexer's
`wq_b`, the shared experts' `gate_up_proj` (`w1`, `w3`) and `down_proj` (`w2`), and the
routed experts. Built unquantized (`quant_config=None`, or layers the fp8 config does not
quantize), so stored in the model's dtype: the compressors' `fused_wkv_wgate`, the
indexer's `weights_proj`, the router `gate` (`GateLinear`), the norms, the embedding and
`head`, and the float32 and int32 tensors. `expert_dtype: fp8` (fp8 block experts with
float32 scales) and `moe_quant_algo` (NVFP4 experts) are refused: not proven here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from shardprep.plan.quant import Scheme
from shardprep.plan.quant.fp8 import BlockQuant
from shardprep.plan.quant.fp8_mxfp4 import Fp8Mxfp4Quant

EXPERT_WEIGHTS = (".w1.weight", ".w3.weight", ".w2.weight")  # gate, up, down of an expert
ROUTED = r"\.ffn\.experts\.\d+\.w[123]\.weight$"  # a routed expert's weight (MXFP4)
# Checkpoint weights (suffix after `layers.N.`) of the fp8 linear layers -> vLLM's layer.
LINEAR = {
    "attn.wq_a.weight": "attn.fused_wqa_wkv",
    "attn.wkv.weight": "attn.fused_wqa_wkv",
    "attn.wq_b.weight": "attn.wq_b",
    "attn.wo_a.weight": "attn.wo_a",
    "attn.wo_b.weight": "attn.wo_b",
    "attn.indexer.wq_b.weight": "attn.indexer.wq_b",
    "ffn.shared_experts.w1.weight": "ffn.shared_experts.gate_up_proj",
    "ffn.shared_experts.w3.weight": "ffn.shared_experts.gate_up_proj",
    "ffn.shared_experts.w2.weight": "ffn.shared_experts.down_proj",
}


def quantized_weights(layers: Sequence[Collection[str]], experts: int) -> dict[str, str]:
    """{checkpoint weight: vLLM layer} of every quantized layer of the model, given each
    decoder layer's tensors but its routed experts (suffixes after `layers.N.`)."""
    found: dict[str, str] = {}
    for layer, own in enumerate(layers):
        prefix = f"layers.{layer}."
        found |= {prefix + w: prefix + v for w, v in LINEAR.items() if w in own}
        stack = prefix + "ffn.experts"
        for e in range(experts):
            found |= {f"{stack}.{e}{w}": stack for w in EXPERT_WEIGHTS}
    return found


def quant_problem(config: Mapping[str, Any]) -> str:
    """Why this DeepSeek-V4 quantization is refused, or ""."""
    quant = config.get("quantization_config") or {}
    expert_dtype = config.get("expert_dtype", "fp4")
    if expert_dtype != "fp4":
        return (
            f"DeepSeek-V4 with expert_dtype {expert_dtype!r} (fp8 block experts) is not "
            "supported yet; shardprep converts the published fp8 + fp4 checkpoint "
            "(expert_dtype fp4)"
        )
    if quant.get("moe_quant_algo"):
        return (
            f"DeepSeek-V4 with moe_quant_algo {quant['moe_quant_algo']!r} is not supported "
            "yet; shardprep converts the published fp8 + fp4 checkpoint (MXFP4 experts)"
        )
    if quant.get("scale_fmt", "ue8m0") != "ue8m0" or quant.get("fmt", "e4m3") != "e4m3":
        return (
            "DeepSeek-V4 fp8 with scales other than ue8m0 or weights other than e4m3 is not "
            "supported; shardprep converts the published checkpoint (e4m3, ue8m0)"
        )
    return ""


def quant_scheme(scheme: Scheme) -> Scheme:
    """fp8 blocks as `DeepseekV4FP8Config` loads them with fp4 experts; others unchanged."""
    if type(scheme) is BlockQuant and not scheme.problem:
        return Fp8Mxfp4Quant(scheme.block, ignored=scheme.ignored, experts_pattern=ROUTED)
    return scheme
