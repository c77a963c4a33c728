"""The layout derived from vLLM's own model definition (plan/derived): for families that
shardprep writes by hand, the derived plan equals the hand-written one piece for piece
(no weights: headers only); what vLLM's load_weights does that no plan expresses is
refused in one line naming the parameter. Without vLLM, the one line that says what to
install is tested in test_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import vllm_env
from derived_models import make_transformers_model
from plans import rank_tensors, source_model

from shardprep.demo.tiny import (
    DEEPSEEK_V4_FP8,
    KIMI_K3_MXFP4,
    TINY_FP8,
    TINY_FP8_CT,
    TINY_INT4,
    TINY_MODELOPT_NVFP4,
    TINY_MXFP4,
    TINY_MXFP4_PACK,
    TINY_NVFP4,
    TINY_NVFP4_PACK,
    TINY_NVFP4A16,
    tiny_config,
)
from shardprep.errors import PlanError, ShardprepError
from shardprep.format.headers import read_header
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.derived import DerivedFamily, available
from shardprep.plan.derived.infer import Hints, Inference
from shardprep.plan.derived.quant import model_scheme
from shardprep.plan.drafts import with_target_rules
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
from shardprep.plan.topology import make_topology

# Deriving runs vLLM in a child of this Python, so vLLM must be installed here.
needs_vllm = pytest.mark.skipif(not available(), reason="deriving needs vLLM installed")

WIDE = {"hidden_size": 256, "head_dim": 128}  # attention of whole 128-blocks per rank at tp2
FP8 = {"quantization_config": TINY_FP8}
# experts of whole blocks per rank (a refined grid is value arithmetic: refused)
MIXTRAL_FP8 = {**WIDE, "num_hidden_layers": 2, "intermediate_size": 256, **FP8}
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
ROUTER_0 = ["model.layers.0.mlp.gate"]
QWEN3_MOE = {**WIDE, "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2}
GLM = {**WIDE, "num_hidden_layers": 3, "intermediate_size": 512, "moe_intermediate_size": 256}
GLM_KEPT = ["lm_head", "model.layers.1.mlp.shared_experts.down_proj"]
NEXT = {**WIDE, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}
# Qwen3-Next's in_proj_ba (8 rows) is left in the model dtype, as published.
NEXT_KEPT = ["lm_head", *(f"model.layers.{i}.linear_attn.in_proj_ba" for i in (0, 2))]
TWO = {"num_hidden_layers": 2}
MXFP4_PACK = {**TWO, "moe_intermediate_size": 128, "hidden_size": 256}
MXFP4_PACK |= {"quantization_config": TINY_MXFP4_PACK}
# Kimi-K3's experts in whole 32-blocks a rank, sizes no MXFP4 MoE backend pads at tp2 (as
# tests/vllm/test_vllm_kimi_k3.py proves them against vLLM)
KIMI_MXFP4 = {"moe_intermediate_size": 256, "routed_expert_hidden_size": 256}
KIMI_MXFP4 |= {"quantization_config": KIMI_K3_MXFP4}
QWEN3_MOE_NVFP4 = {**TWO, "moe_intermediate_size": 96, "quantization_config": TINY_NVFP4}
MODELOPT = {"quantization_config": TINY_MODELOPT_NVFP4}
FP8_CT = {"quantization_config": TINY_FP8_CT}


def fp8_ct(strategy: str, inputs: dict[str, Any], **weights: Any) -> dict[str, Any]:
    """compressed-tensors fp8 of another strategy than TINY_FP8_CT's per channel."""
    group = dict(TINY_FP8_CT["config_groups"]["group_0"])
    group["weights"] = {**group["weights"], "strategy": strategy, **weights}
    group["input_activations"] = {**group["input_activations"], **inputs}
    return {"quantization_config": {**TINY_FP8_CT, "config_groups": {"group_0": group}}}


# DeepSeek's MLP, shared and routed experts in whole 128-blocks a rank at tp2
MLA_BLOCKS = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256}
MLA_BLOCKS |= {"n_shared_experts": 2}
# Kimi-K2.6 as published: int4 routed experts in groups of 32, whole groups a rank
K26_INT4 = {"moe_intermediate_size": 128, "hidden_size": 256, "quantization_config": TINY_INT4}


def fp8(kept: list[str]) -> dict[str, Any]:
    return {"quantization_config": TINY_FP8 | {"modules_to_not_convert": kept}}


# whole 128-blocks of DeepSeek-V4's fp8 projections and 32-blocks of its MXFP4 experts a rank
V4_SIZES = {"q_lora_rank": 128, "o_lora_rank": 128, "moe_intermediate_size": 256}
# name: (architecture, tp, pp, config overrides); every family module's architectures,
# the tiny configs of shardprep's own tests (which cover each cut the family makes)
CASES: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "llama-tp2-pp2": ("LlamaForCausalLM", 2, 2, {}),
    "llama-tp4-kv-replicated": ("LlamaForCausalLM", 4, 1, {}),
    "mistral-tp2": ("MistralForCausalLM", 2, 1, {}),
    "qwen2-tied-bias-tp2-pp2": ("Qwen2ForCausalLM", 2, 2, {"tie_word_embeddings": True}),
    "qwen3-tp2": ("Qwen3ForCausalLM", 2, 1, {}),
    "qwen3-moe-tp2": ("Qwen3MoeForCausalLM", 2, 1, {}),
    "mixtral-tp2-pp2": ("MixtralForCausalLM", 2, 2, {}),
    # MLA without q_lora_rank (V2-Lite), greedy routing
    "deepseek-v2-tp2-pp2": ("DeepseekV2ForCausalLM", 2, 2, {}),
    # MLA, a fused q_a/kv_a projection, shared and routed experts, dense first layer
    "deepseek-v3-tp2-pp2": ("DeepseekV3ForCausalLM", 2, 2, {"num_hidden_layers": 5}),
    # V3 with the indexer (its fused, replicated wk_weights_proj)
    "deepseek-v3.2-tp2-pp2": ("DeepseekV32ForCausalLM", 2, 2, {}),
    # native naming, hash-routed and compressed layers, hyper-connections
    "deepseek-v4-tp2": ("DeepseekV4ForCausalLM", 2, 1, {}),
    # DeepSeek-V3 under language_model. and a MoonViT tower cut by heads
    "kimi-k2.5-tp2-pp2": ("KimiK25ForConditionalGeneration", 2, 2, {}),
    # qkv bias, q/k norms, a float32 router; one KV head, replicated at tp2
    "glm-4.5-tp2-pp2": ("Glm4MoeForCausalLM", 2, 2, {"num_key_value_heads": 1}),
    # gated DeltaNet layers (conv1d's q, k and v rows) and gated attention in turn
    "qwen3-next-tp2-pp2": ("Qwen3NextForCausalLM", 2, 2, {}),
    "gpt-oss-tp2": ("GptOssForCausalLM", 2, 1, {}),
    "qwen3.5-moe-tp2": ("Qwen3_5MoeForConditionalGeneration", 2, 1, {}),
    "kimi-k3-tp2": ("KimiK3ForConditionalGeneration", 2, 1, {}),
    # Quantized: each scheme's tensors at sizes of whole blocks per rank, as vLLM needs
    "deepseek-v2-fp8-tp2": ("DeepseekV2ForCausalLM", 2, 1, {"num_hidden_layers": 2, **FP8}),
    "deepseek-v3-fp8-tp2-pp2": ("DeepseekV3ForCausalLM", 2, 2, {"num_hidden_layers": 5, **FP8}),
    "qwen3-fp8-tp2-pp2": ("Qwen3ForCausalLM", 2, 2, {**WIDE, "intermediate_size": 512, **FP8}),
    # the router of layer 0 left in the model's dtype, that of layer 1 an fp8 layer
    "qwen3-moe-fp8-tp2": ("Qwen3MoeForCausalLM", 2, 1, QWEN3_MOE | fp8(ROUTER_0)),
    "mixtral-fp8-tp2": ("MixtralForCausalLM", 2, 1, MIXTRAL_FP8),
    "glm-4.5-fp8-tp2-pp2": ("Glm4MoeForCausalLM", 2, 2, GLM | fp8(GLM_KEPT)),
    "qwen3-next-fp8-tp2": ("Qwen3NextForCausalLM", 2, 1, NEXT | fp8(NEXT_KEPT)),
    # compressed-tensors fp8 per output channel (llm-compressor's -FP8-dynamic)
    "qwen3-moe-fp8-ct-tp2": (
        "Qwen3MoeForCausalLM",
        2,
        1,
        {"moe_intermediate_size": 96, "num_hidden_layers": 2, "quantization_config": TINY_FP8_CT},
    ),
    "deepseek-v3-int4-tp2": ("DeepseekV3ForCausalLM", 2, 1, {"quantization_config": TINY_INT4}),
    "deepseek-v3-nvfp4-tp2": (
        "DeepseekV3ForCausalLM",
        2,
        1,
        {"quantization_config": TINY_NVFP4_PACK},
    ),
    "mixtral-fp8-per-tensor-tp2": (
        "MixtralForCausalLM",
        2,
        1,
        {"num_hidden_layers": 2, "quantization_config": PER_TENSOR},
    ),
    # fp4: compressed-tensors MXFP4 experts (packed bytes, e8m0 group scales), NVFP4 linear
    # layers and experts (global scales per part, per expert and part), ModelOpt's NVFP4
    "deepseek-v3-mxfp4-pack-tp2": ("DeepseekV3ForCausalLM", 2, 1, MXFP4_PACK),
    "kimi-k3-mxfp4-tp2": ("KimiK3ForConditionalGeneration", 2, 1, KIMI_MXFP4),
    "qwen3-nvfp4-tp2-pp2": ("Qwen3ForCausalLM", 2, 2, {**TWO, "quantization_config": TINY_NVFP4}),
    "qwen3-moe-nvfp4-tp2": ("Qwen3MoeForCausalLM", 2, 1, QWEN3_MOE_NVFP4),
    "llama-nvfp4a16-tp2": ("LlamaForCausalLM", 2, 1, {**TWO, "quantization_config": TINY_NVFP4A16}),
    "llama-modelopt-nvfp4-tp2": ("LlamaForCausalLM", 2, 1, {**TWO, **MODELOPT}),
    "qwen3-moe-modelopt-nvfp4-tp2-pp2": ("Qwen3MoeForCausalLM", 2, 2, {**TWO, **MODELOPT}),
    # MXFP4 experts as published, whole 32-blocks a rank (no backend pads them)
    "gpt-oss-mxfp4-tp2": ("GptOssForCausalLM", 2, 1, {"quantization_config": TINY_MXFP4}),
    # DeepSeek-V4 as published: fp8 blocks with e8m0 scales, MXFP4 routed experts
    "deepseek-v4-fp8-fp4-tp2": (
        "DeepseekV4ForCausalLM",
        2,
        1,
        {"quantization_config": DEEPSEEK_V4_FP8, "expert_dtype": "fp4", **V4_SIZES},
    ),
    # Each scheme on every family that converts it, beside the cases above
    "kimi-k2.5-int4-tp2-pp2": (
        "KimiK25ForConditionalGeneration",
        2,
        2,
        {"num_hidden_layers": 3, **K26_INT4},
    ),
    "kimi-k2.5-mxfp4-pack-tp2": ("KimiK25ForConditionalGeneration", 2, 1, MXFP4_PACK),
    "kimi-k2.5-nvfp4-tp2": (
        "KimiK25ForConditionalGeneration",
        2,
        1,
        {**TWO, "quantization_config": TINY_NVFP4_PACK},
    ),
    "deepseek-v3.2-fp8-tp2-pp2": ("DeepseekV32ForCausalLM", 2, 2, {**MLA_BLOCKS, **FP8}),
    "deepseek-v3.2-int4-tp2": ("DeepseekV32ForCausalLM", 2, 1, {"quantization_config": TINY_INT4}),
    "deepseek-v3.2-mxfp4-pack-tp2": ("DeepseekV32ForCausalLM", 2, 1, MXFP4_PACK),
    "deepseek-v3.2-nvfp4-tp2": (
        "DeepseekV32ForCausalLM",
        2,
        1,
        {"quantization_config": TINY_NVFP4_PACK},
    ),
    "deepseek-v3-fp8-ct-tp2": ("DeepseekV3ForCausalLM", 2, 1, {**TWO, **FP8_CT}),
    "llama-fp8-ct-tp2-pp2": ("LlamaForCausalLM", 2, 2, FP8_CT),
    "llama-fp8-ct-per-tensor-tp2": (
        "LlamaForCausalLM",
        2,
        1,
        fp8_ct("tensor", {"strategy": "tensor", "dynamic": False}),
    ),
    "qwen3-moe-fp8-ct-blocks-tp2": (
        "Qwen3MoeForCausalLM",
        2,
        1,
        QWEN3_MOE
        | fp8_ct("block", {"strategy": "group", "group_size": 128}, block_structure=[128, 128]),
    ),
    "mixtral-fp8-ct-tp2": ("MixtralForCausalLM", 2, 1, {**TWO, **FP8_CT}),
    "qwen3-moe-fp8-per-tensor-tp2": (
        "Qwen3MoeForCausalLM",
        2,
        1,
        {**TWO, "quantization_config": PER_TENSOR},
    ),
    # KV-cache scales as AutoFP8 (layer 0: scalars) and ModelOpt (layer 1: [1]) ship them
    "qwen3-fp8-per-tensor-kv-scales-tp2-pp2": (
        "Qwen3ForCausalLM",
        2,
        2,
        {"num_hidden_layers": 2, "quantization_config": PER_TENSOR},
    ),
}
# The tensors a case's checkpoint ships beyond those its config implies.
SHIPPED: dict[str, dict[str, tuple[int, ...]]] = {
    "qwen3-fp8-per-tensor-kv-scales-tp2-pp2": {
        "model.layers.0.self_attn.k_scale": (),
        "model.layers.0.self_attn.v_scale": (),
        "model.layers.1.self_attn.k_proj.k_scale": (1,),
        "model.layers.1.self_attn.v_proj.v_scale": (1,),
    },
}
# What the derivation cannot express yet, in one line each (strict: a fix shows): it
# refuses (PlanError) or infers other pieces than the family's (AssertionError).
NOT_YET: dict[str, str] = {}
# What the vLLM of a case needs beside the model: torchvision's Python part (Qwen3.5's
# classes import it), the Kimi-K3 GEMM that is not fused with an all-reduce.
ENVIRONMENT = {name: {"VLLM_KIMI_K3_GEMM_AR": "0"} for name in ("kimi-k3-tp2", "kimi-k3-mxfp4-tp2")}
TORCHVISION = {"qwen3.5-moe-tp2"}


def _context(pp: int, dtypes: Mapping[str, str] | None = None) -> PlanContext:
    """`dtypes`: the checkpoint's, where not the model's (`quantized.source_dtypes`)."""
    return PlanContext(pp=pp, dtypes=dtypes or {})


def _case(name: str) -> Any:
    if name not in NOT_YET:
        return name
    not_yet = pytest.mark.xfail(
        strict=True, raises=(PlanError, AssertionError), reason=NOT_YET[name]
    )
    return pytest.param(name, marks=not_yet)


def test_every_registered_architecture_has_a_case() -> None:
    assert set(archs.supported()[0]) <= {arch for arch, *_ in CASES.values()}


def _covered(cases: Mapping[str, tuple[str, int, int, dict[str, Any]]]) -> set[tuple[str, str]]:
    """(family, scheme or "") of each case, the scheme as its config.json declares it."""
    found = set()
    for arch, _, _, overrides in cases.values():
        scheme = model_scheme(tiny_config(arch, **overrides))  # or its text_config's
        found.add((archs.target_family_of(arch).name, scheme.name if scheme else ""))
    return found


def test_every_scheme_of_every_family_has_a_case() -> None:
    families = {archs.target_family_of(arch) for arch in archs.supported()[0]}
    wanted = {(f.name, s) for f in families for s in {"", *f.quant_schemes}}
    assert wanted <= _covered(CASES)


@pytest.mark.parametrize("case", [_case(name) for name in sorted(CASES)])
@pytest.mark.vllm
@needs_vllm
def test_derived_plan_equals_the_hand_written_plan(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, tp, pp, overrides = CASES[case]
    for key, value in ENVIRONMENT.get(case, {}).items():
        monkeypatch.setenv(key, value)
    if case in TORCHVISION and vllm_env.torchvision_path() is not None:
        monkeypatch.setenv("PYTHONPATH", vllm_env.with_torchvision()["PYTHONPATH"])
    published = tiny_config(arch, **overrides)  # vLLM reads config.json as published
    config = archs.read_config(published)
    _, family = archs.target_family(config)
    shapes = quantized.expected_shapes(family, config) | SHIPPED.get(case, {})
    dtypes = quantized.source_dtypes(family, config)
    # what convert adds: the weights vLLM dequantizes while loading (DeepSeek-V3.2's wk)
    computed = family.dequantized_sources(config, dtypes, shapes)
    shapes |= {name: shapes[weight] for name, (weight, _) in computed.items()}
    topology = make_topology(config["num_hidden_layers"], tp, pp, None, "")
    written = quantized.layout(family, config, shapes, topology, _context(pp))
    written = with_target_rules(family, config, shapes, topology, written, _context(pp))
    derived = DerivedFamily().layout(published, shapes, topology, _context(pp, dtypes))
    assert {p.name: p for p in derived.params} == {p.name: p for p in written.params}
    assert derived.computed == computed
    assert set(derived.skipped) == set(written.skipped)
    assert derived.num_experts == written.num_experts


def _renamed(name: str, prefixes: dict[str, str]) -> str:
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


# Qwen3.5-MoE's language model under the text-only class's names: vLLM's, the checkpoint's
TEXT_PARAMS = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
TEXT_SOURCES = {"model.language_model.": "model."}


@pytest.mark.vllm
@needs_vllm
def test_the_text_only_qwen3_5_moe_class_derives_the_families_language_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`Qwen3_5MoeForCausalLM`, which no family names, is the language model of
    `Qwen3_5MoeForConditionalGeneration` under `model.` (its checkpoint's names and
    vLLM's): its derived plan is the hand-written family's, but the tower, piece for piece."""
    monkeypatch.setenv("PYTHONPATH", vllm_env.with_torchvision()["PYTHONPATH"])
    published = tiny_config("Qwen3_5MoeForConditionalGeneration")
    config = archs.read_config(published)
    family = archs.target_family(config)[1]
    shapes = quantized.expected_shapes(family, config)
    topology = make_topology(config["num_hidden_layers"], 2, 2, None, "")
    written = quantized.layout(family, config, shapes, topology, _context(2))
    text = {**published["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"]}
    assert archs.target_family(text)[1].name == "derived"
    text_shapes = {
        _renamed(name, TEXT_SOURCES): shape
        for name, shape in shapes.items()
        if not name.startswith("model.visual.")
    }
    derived = DerivedFamily().layout(text, text_shapes, topology, _context(2))
    expected = {
        _renamed(param.name, TEXT_PARAMS): tuple(
            piece._replace(source=_renamed(piece.source, TEXT_SOURCES)) for piece in param.pieces
        )
        for param in written.params
        if not param.name.startswith("visual.")
    }
    assert {p.name: p.pieces for p in derived.params} == expected
    assert set(derived.skipped) == {_renamed(name, TEXT_SOURCES) for name in written.skipped}
    stages = {p.name: p.stages for p in derived.params}
    assert stages["lm_head.weight"] == (1,) and stages["model.embed_tokens.weight"] == (0, 1)
    assert derived.num_experts == written.num_experts == 8


def _unnamed(architecture: str, model_type: str, **overrides: Any) -> SourceModel:
    """A tiny Llama's tensors under an architecture vLLM registers and no family names."""
    llama = source_model(tiny_config("LlamaForCausalLM", **overrides))
    config = {**llama.config, "architectures": [architecture], "model_type": model_type}
    return SourceModel(config, llama.tensors)


@pytest.mark.vllm
@needs_vllm
def test_an_fp8_block_checkpoint_no_family_names_plans_its_derived_layout() -> None:
    source = _unnamed("GraniteForCausalLM", "granite", **WIDE, intermediate_size=512, **FP8)
    plan = make_plan(source, ConversionRequest(tp=2, pp=1))
    tensors = rank_tensors(plan, 0, 1)
    qkv = "model.layers.0.self_attn.qkv_proj."
    # q 256, k 128 and v 128 rows of the rank: scale rows 2 + 1 + 1, of 256 / 128 columns
    assert (tensors[qkv + "weight"].dtype, tensors[qkv + "weight"].shape) == ("F8_E4M3", (512, 256))
    scale = tensors[qkv + "weight_scale_inv"]
    assert (scale.dtype, scale.shape) == ("F32", (4, 2))
    assert [b.source for b in scale.blocks] == [
        f"model.layers.0.self_attn.{p}_proj.weight_scale_inv" for p in "qkv"
    ]


@pytest.mark.parametrize(
    "quant, scale, shape",
    [
        (PER_TENSOR, "weight_scale", (3,)),  # one an fused part, as vLLM keeps them
        (TINY_FP8_CT, "weight_scale", (512, 1)),  # one a row of the rank
    ],
    ids=["fp8-per-tensor", "compressed-tensors-fp8-per-channel"],
)
@pytest.mark.vllm
@needs_vllm
def test_an_fp8_checkpoint_of_another_kind_no_family_names_plans_its_derived_layout(
    quant: dict[str, Any], scale: str, shape: tuple[int, ...]
) -> None:
    source = _unnamed("GraniteForCausalLM", "granite", **WIDE, quantization_config=quant)
    plan = make_plan(source, ConversionRequest(tp=2, pp=1))
    tensors = rank_tensors(plan, 0, 1)
    qkv = "model.layers.0.self_attn.qkv_proj."
    assert (tensors[qkv + "weight"].dtype, tensors[qkv + "weight"].shape) == ("F8_E4M3", (512, 256))
    assert (tensors[qkv + scale].dtype, tensors[qkv + scale].shape) == ("F32", shape)


@pytest.mark.vllm
@needs_vllm
def test_an_nvfp4_checkpoint_no_family_names_plans_its_derived_layout() -> None:
    """ModelOpt NVFP4: the packed weight under its own name, cut in whole bytes of its
    [N, K] (o_proj's 64 of 128 columns a rank: 32 bytes), a scale per part of a fused layer."""
    source = _unnamed("GraniteForCausalLM", "granite", quantization_config=TINY_MODELOPT_NVFP4)
    plan = make_plan(source, ConversionRequest(tp=2, pp=1))
    tensors = rank_tensors(plan, 0, 1)
    attention = "model.layers.0.self_attn."
    o_proj = tensors[attention + "o_proj.weight"]
    assert (o_proj.dtype, o_proj.shape) == ("U8", (128, 32))
    assert o_proj.blocks[0].cols == (32, 64)
    scale = tensors[attention + "qkv_proj.weight_scale_2"]
    assert (scale.dtype, scale.shape) == ("F32", (3,))


@pytest.mark.vllm
@needs_vllm
def test_a_scheme_not_proven_derived_is_refused_in_one_line() -> None:
    source = _unnamed("GraniteForCausalLM", "granite", quantization_config=TINY_INT4)
    with pytest.raises(ShardprepError) as info:
        make_plan(source, ConversionRequest(tp=2, pp=1))
    assert "\n" not in str(info.value)
    assert (
        "compressed-tensors checkpoints (int4_pack) of the derived family are not supported "
        "yet: shardprep's layout of them is not proven against vLLM; convert an unquantized "
        "checkpoint"
    ) in str(info.value)


@pytest.mark.vllm
@needs_vllm
def test_mxfp4_experts_a_backend_pads_are_refused_naming_the_parameter() -> None:
    """An intermediate size of three 32-blocks at tp2: rank 0 loads two, rank 1 one, each
    into the corner of a parameter padded to two; the hand-written plan writes the blocks
    unpadded (the loader pads them), which vLLM's record does not show."""
    published = tiny_config(
        "GptOssForCausalLM", intermediate_size=96, quantization_config=TINY_MXFP4
    )
    config = archs.read_config(published)
    family = archs.target_family(config)[1]
    shapes = quantized.expected_shapes(family, config)
    topology = make_topology(config["num_hidden_layers"], 2, 1, None, "")
    dtypes = quantized.source_dtypes(family, config)
    with pytest.raises(PlanError) as info:
        DerivedFamily().layout(published, shapes, topology, _context(1, dtypes))
    assert str(info.value) == (
        "vLLM's load_weights writes model.layers.0.mlp.experts.routed_experts.w2_weight in a "
        "strided region (sizes [512, 16], strides [32, 1]), which a plan of whole rows cannot "
        "express"
    )


@pytest.mark.vllm
@needs_vllm
def test_value_arithmetic_in_load_weights_is_refused_naming_the_parameter(
    tmp_path: Path,
) -> None:
    """vLLM's Mamba loader stores A = -exp(A_log): no copy of checkpoint bytes makes it."""
    model = make_transformers_model(tmp_path / "mamba", "MambaForCausalLM")
    header = read_header(model / "model.safetensors")
    tensors = {name: (info.dtype, info.shape) for name, info in header.tensors.items()}
    config = json.loads((model / "config.json").read_text())
    with pytest.raises(PlanError) as info:
        make_plan(SourceModel(config, tensors), ConversionRequest(tp=2, pp=1))
    assert str(info.value) == (
        "cannot derive the layout from vLLM: backbone.layers.0.mixer.A: vLLM's load_weights "
        "computes it from backbone.layers.0.mixer.A_log (cast, exp, neg), value arithmetic a "
        "plan of copies cannot express"
    )


@pytest.mark.vllm
@needs_vllm
def test_an_architecture_vllm_does_not_register_either_is_one_line() -> None:
    config = tiny_config()
    shapes = archs.target_family(config)[1].expected_shapes(config)
    config["architectures"] = ["NoSuchForCausalLM"]
    with pytest.raises(PlanError) as info:
        make_plan(
            SourceModel(config, {n: ("F32", s) for n, s in shapes.items()}),
            ConversionRequest(tp=2, pp=1),
        )
    assert str(info.value) == (
        "cannot derive the layout from vLLM: architecture NoSuchForCausalLM is not registered "
        "in vLLM 0.32.0 either, so there is no model definition to derive its layout from; "
        "use a vLLM that serves it"
    )


def _record(ops: list[list[Any]], params: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return {"rank": [0, rank], "model_dtype": "F32", "params": params, "ops": ops}


def test_a_strided_write_a_gap_and_a_fill_of_a_value_are_refused_naming_the_parameter() -> None:
    sources = {"w": ("F32", (4, 4))}
    params = {"p": ["F32", [4, 4]]}
    strided = ["copy", "p", [0, [4, 2], [4, 1]], "w", [0, [4, 2], [4, 1]], "F32"]
    with pytest.raises(PlanError, match="writes p in a strided region"):
        Inference({}, sources, 1).add(_record([strided], params))
    gap = ["copy", "p", [0, [2, 4], [4, 1]], "w", [0, [2, 4], [4, 1]], "F32"]
    with pytest.raises(PlanError, match="leaves 8 of the 16 values of p unwritten"):
        Inference({}, sources, 1).add(_record([gap], params))
    ones = ["fill", "p", [8, [2, 4], [4, 1]], 1.0]
    with pytest.raises(PlanError, match="fills p with 1.0"):
        Inference({}, sources, 1).add(_record([gap, ones], params))


def test_rows_that_follow_no_cut_are_refused_naming_the_parameter() -> None:
    """Rank 1 reads the same rows as rank 0: not a split, not a copy of the whole."""
    sources = {"w": ("F32", (4, 4))}
    params = {"p": ["F32", [2, 4]]}
    inference = Inference({}, sources, 2)
    for rank in (0, 1):
        ops = [["copy", "p", [0, [2, 4], [4, 1]], "w", [0, [2, 4], [4, 1]], "F32"]]
        inference.add(_record(ops, params, rank))
    with pytest.raises(PlanError, match=r"1 parameter\(s\): p <- w: vLLM's load_weights copies"):
        inference.layout()


def test_a_parameter_reshaped_from_its_source_is_refused_naming_it() -> None:
    """vLLM squeezes a [1, 4] routing bias to [4]: the same values, a shape no cut gives."""
    sources = {"bias": ("F32", (1, 4))}
    inference = Inference({}, sources, 1)
    ops = [["copy", "p", [0, [4], [1]], "bias", [0, [4], [1]], "F32"]]
    inference.add(_record(ops, {"p": ["F32", [4]]}))
    with pytest.raises(PlanError, match=r"p <- bias: vLLM holds \[4\] where the checkpoint's re"):
        inference.layout()


def _row(offset: int) -> list[Any]:
    """One row of 3 values, as a region (offset, sizes, strides)."""
    return [offset, [1, 3], [3, 1]]


def test_experts_stacked_in_one_source_are_read_each_from_its_own_matrix() -> None:
    """A [2 experts, 2 x 2 rows, 3] gate-up stack into vLLM's [2, 2, 3] w13 at tp 2: each
    rank copies its row of each half of each expert; each expert is a piece of its own."""
    inference = Inference({}, {"gu": ("F32", (2, 4, 3))}, 2)
    for rank in (0, 1):
        ops = [
            ["copy", "w13", _row((2 * e + h) * 3), "gu", _row((4 * e + 2 * h + rank) * 3), "F32"]
            for e in (0, 1)
            for h in (0, 1)
        ]
        inference.add(_record(ops, {"w13": ["F32", [2, 2, 3]]}, rank))
    layout = inference.layout()
    (param,) = layout.params
    assert param.pieces == tuple(Piece("gu", Cut.EXPERT_HALVES_ROWS, expert=e) for e in (0, 1))
    assert layout.num_experts == 2


def test_a_text_models_config_gives_the_hints_of_a_wrapper_that_holds_it() -> None:
    """A vision-language wrapper's config.json keeps the text model's heads and
    vocabulary under text_config, where vLLM's hf_text_config reads them."""
    text = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    hints = Hints(heads=2, rows=64, vocab=1000, q_heads=4)
    assert Hints.of({"text_config": text | {"vocab_size": 1000}}) == hints
    assert Hints.of({"vocab_size": 1000, "text_config": text}) == hints
    assert Hints.of(text | {"vocab_size": 1000}) == hints


def test_one_value_per_expert_and_part_of_an_experts_layer_is_a_stack_of_experts() -> None:
    """A [2 experts, 2 parts] and a [2 experts] vector of per-tensor scales that vLLM's
    experts layer holds (the record's expert stacks) stack experts; the same [2] vector
    of another layer is a fused layer's per-part values."""
    sources = {f"e{e}.{part}": ("F32", (1,)) for e in (0, 1) for part in "gud"}
    sources |= {f"e{e}.w": ("F32", (2, 3)) for e in (0, 1)}
    params = {"m.w": ["F32", [2, 2, 3]], "m.s13": ["F32", [2, 2]], "m.s2": ["F32", [2]]}
    params |= {"attn.s": ["F32", [2]]}
    one = [0, [1], [1]]
    ops = [["copy", "m.w", [6 * e, [2, 3], [3, 1]], f"e{e}.w", [0, [2, 3], [3, 1]], "F32"]
           for e in (0, 1)]  # fmt: skip
    ops += [["copy", "m.s13", [2 * e + j, [1], [1]], f"e{e}.{p}", one, "F32"]
            for e in (0, 1) for j, p in enumerate("gu")]  # fmt: skip
    ops += [["copy", "m.s2", [e, [1], [1]], f"e{e}.d", one, "F32"] for e in (0, 1)]
    ops += [["copy", "attn.s", [e, [1], [1]], f"e{e}.d", one, "F32"] for e in (0, 1)]
    inference = Inference({}, sources, 1)
    inference.add(_record(ops, params) | {"expert_stacks": ["m.w", "m.s13", "m.s2"]})
    layout = inference.layout()
    pieces = {param.name: param.pieces for param in layout.params}
    assert pieces["m.s13"] == tuple(
        Piece(f"e{e}.{p}", Cut.PER_TENSOR, expert=e) for e in (0, 1) for p in "gu"
    )
    assert pieces["m.s2"] == tuple(Piece(f"e{e}.d", Cut.PER_TENSOR, expert=e) for e in (0, 1))
    assert pieces["attn.s"] == tuple(Piece(f"e{e}.d", Cut.REPLICATE) for e in (0, 1))
    assert layout.num_experts == 2


NO_VLLM_IMPORT = """
import sys
from shardprep.demo.tiny import tiny_config
from shardprep.plan import archs
from shardprep.format.request import ConversionRequest
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
import shardprep.convert.record  # the manifest's layout record knows the derived revision
config = tiny_config()
shapes = archs.target_family(config)[1].expected_shapes(config)
tensors = {n: ("BF16", s) for n, s in shapes.items()}
make_plan(SourceModel(config, tensors), ConversionRequest(tp=2, pp=2))
print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
"""


def test_planning_a_family_never_imports_vllm() -> None:
    """vLLM runs only in the deriving child: a family's plan (and convert's manifest code)
    works where vLLM is not installed, and costs nothing of it where it is."""
    out = subprocess.run(
        [sys.executable, "-c", NO_VLLM_IMPORT], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
