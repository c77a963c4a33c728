"""Every registered family against every fp8 scheme: each pair converts, or is refused
before anything is read with one line that says why.

The schemes as checkpoints declare them: `quant_method: fp8` with `weight_block_size`
(fp8 blocks) or without it (per tensor; vLLM's `fp8` method has no per-channel form),
compressed-tensors `float-quantized` by tensor, channel or block, and FBGEMM's per-channel
`fbgemm_fp8`, which shardprep refuses for every family. Blocks of 32 here keep the tiny
models' per-rank sizes whole blocks at tp2 (the published 128 x 128 are planned in
test_fp8.py and proven in tests/vllm/test_vllm_fp8*.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from plans import source_model

from shardprep.demo.tiny import TINY_FP8_CT, tiny_config
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.checks import UNPROVEN, loading_problems
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel


def _ct(strategy: str, inputs: dict[str, Any], **weights: Any) -> dict[str, Any]:
    group = dict(TINY_FP8_CT["config_groups"]["group_0"])
    group["weights"] = {**group["weights"], "strategy": strategy, **weights}
    group["input_activations"] = {**group["input_activations"], **inputs}
    # Qwen3-Next's in_proj_ba (8 rows) is left in the model dtype, as published.
    return {**TINY_FP8_CT, "config_groups": {"group_0": group},
            "ignore": [*TINY_FP8_CT["ignore"], "re:.*in_proj_ba$"]}  # fmt: skip


NOT_CONVERTED = [f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(4)]
SCHEMES: dict[str, dict[str, Any]] = {
    "fp8 blocks": {"quant_method": "fp8", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32], "modules_to_not_convert": NOT_CONVERTED},
    "fp8 per tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "compressed-tensors tensor": _ct("tensor", {"strategy": "tensor", "dynamic": False}),
    "compressed-tensors channel": _ct("channel", {}),
    "compressed-tensors block": _ct("block", {"strategy": "group", "group_size": 32},
                                    block_structure=[32, 32]),
    "fbgemm per channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
}  # fmt: skip
EVERY_FP8 = {"fp8 blocks", "fp8 per tensor"}
EVERY_CT = {"compressed-tensors tensor", "compressed-tensors channel", "compressed-tensors block"}
PUBLISHED_BLOCKS = "is published with fp8 blocks (quant_method fp8, weight_block_size)"
# family -> (the schemes it converts, the reason it gives for the others)
TABLE: dict[str, tuple[set[str], str]] = {
    "llama": (EVERY_FP8 | EVERY_CT, ""),
    "qwen3_moe": (EVERY_FP8 | EVERY_CT, ""),
    "mixtral": (EVERY_FP8 | EVERY_CT, ""),
    "deepseek": ({"fp8 blocks"} | EVERY_CT, UNPROVEN),
    "deepseek_v32": ({"fp8 blocks"}, "read from fp8 blocks only"),
    "kimi_k25": (set(), "quantizes the vision tower and projector too"),
    "deepseek_v4": ({"fp8 blocks"}, "converted unquantized or as published (fp8 blocks, fp4"),
    "glm4_moe": ({"fp8 blocks"}, f"GLM-4.5 {PUBLISHED_BLOCKS}"),
    "qwen3_next": ({"fp8 blocks"}, f"Qwen3-Next {PUBLISHED_BLOCKS}"),
    "gpt_oss": (set(), "gpt-oss is published with MXFP4 experts"),
    "kimi_k3": (set(), UNPROVEN),
    "qwen3_5_moe": (set(), UNPROVEN),
}
# Sizes a family's tiny model takes for its quantization to plan at tp2: DeepSeek-V4's fp4
# experts (`expert_dtype`, fp4 when absent) of 128 rows a rank, which no MXFP4 backend pads.
SIZES = {"deepseek_v4": {"moe_intermediate_size": 256}}
# MTP drafts inside a target checkpoint follow their target's row.
INTERNAL_DRAFTS = {"deepseek": "deepseek_mtp", "deepseek_v32": "deepseek_v32_mtp",
                   "glm4_moe": "glm4_moe_mtp", "qwen3_next": "qwen3_next_mtp"}  # fmt: skip


def _source(config: dict[str, Any]) -> SourceModel:
    read = archs.read_config(config)
    _, family = archs.target_family(read)
    tensors = dict(source_model(read, family).tensors)
    shapes = quantized.expected_shapes(family, read)
    # what convert adds: the weights vLLM dequantizes while loading (DeepSeek-V3.2's wk)
    stored = {n: dtype for n, (dtype, _) in tensors.items()}
    for name, (weight, _) in family.dequantized_sources(read, stored, shapes).items():
        tensors[name] = ("BF16", shapes[weight])
    return SourceModel(config, tensors)


def test_the_table_names_every_registered_target_family() -> None:
    families = {archs.target_family_of(arch).name for arch in archs.supported()[0]}
    assert families == set(TABLE)


@pytest.mark.parametrize("architecture", archs.supported()[0])
def test_every_fp8_scheme_converts_or_is_refused_in_one_line(architecture: str) -> None:
    family = archs.target_family_of(architecture)
    converts, why = TABLE[family.name]
    for scheme, quant in SCHEMES.items():
        config = tiny_config(architecture, quantization_config=quant, **SIZES.get(family.name, {}))
        problems = loading_problems(archs.read_config(config), family)
        if scheme in converts:
            assert problems == [], (architecture, scheme)
            plan = make_plan(_source(config), ConversionRequest(tp=2, pp=2))
            dtypes = {t.dtype for f in plan.files for t in f.tensors}
            assert "F8_E4M3" in dtypes, (architecture, scheme)
            continue
        (problem,) = problems
        assert "\n" not in problem
        if scheme == "fbgemm per channel":
            assert problem.startswith("quantization_config has quant_method 'fbgemm_fp8'; ")
            continue
        assert problem.startswith(f"{quant['quant_method']} checkpoints (fp8_"), problem
        assert f" of the {family.name} family are not supported yet: " in problem
        assert why in problem and problem.endswith("; convert an unquantized checkpoint")


def test_an_mtp_draft_converts_what_its_target_converts() -> None:
    targets = {
        archs.target_family_of(a).name: archs.target_family_of(a) for a in archs.supported()[0]
    }
    for target, draft in INTERNAL_DRAFTS.items():
        family = archs.draft_family("mtp", target)
        assert family.name == draft
        assert family.quant_schemes == targets[target].quant_schemes, draft
        assert family.quant_refusals == targets[target].quant_refusals, draft


def test_a_standalone_draft_refuses_every_fp8_scheme() -> None:
    for method in archs.standalone_methods():
        family = archs.draft_family(method, "llama")
        for quant in SCHEMES.values():
            (problem,) = loading_problems({"quantization_config": quant}, family)
            assert "not supported yet" in problem or "quant_method 'fbgemm_fp8'" in problem
