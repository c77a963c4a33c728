"""What a derivation feeds vLLM and how it reads a quantized checkpoint back, without
vLLM: the placeholders' dtypes (derived/placeholders.py), the scheme of a model whose
quantization config sits under text_config, the schemes that load the same stored tensors
through another vLLM method (derived/quant.py), and the cut an expert's rows prefer."""

from __future__ import annotations

from shardprep.demo.tiny import KIMI_K3_MXFP4, TINY_FP8, TINY_MXFP4_PACK
from shardprep.plan.cuts import Cut
from shardprep.plan.derived.infer import Hints, candidates
from shardprep.plan.derived.placeholders import placeholders
from shardprep.plan.derived.quant import model_scheme, variants
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.fp4 import Mxfp4PackMoeQuant, Mxfp4PackQuant
from shardprep.plan.quant.fp8 import BlockQuant
from shardprep.plan.quant.fp8_mxfp4 import Fp8Mxfp4Quant

SHAPES = {
    "norm": (8,),
    "bias": (8,),
    "w.weight_packed": (8, 16),
    "w.weight_scale": (8, 1),
    "e8m0": (8, 1),
    "fp8": (8, 32),
    "int4": (8, 4),
    "unknown": (4,),
}
DTYPES = {
    "norm": "F16",
    "bias": "F32",
    "w.weight_packed": "U8",
    "w.weight_scale": "U8",
    "e8m0": "F8_E8M0",
    "fp8": "F8_E4M3",
    "int4": "I32",
}


def test_placeholders_keep_a_quantized_dtype_and_take_the_serving_one_for_floating_point() -> None:
    assert placeholders(SHAPES, DTYPES, "BF16") == {
        "norm": ("BF16", (8,)),
        "bias": ("BF16", (8,)),
        "w.weight_packed": ("U8", (8, 16)),
        "w.weight_scale": ("U8", (8, 1)),
        "e8m0": ("F8_E8M0", (8, 1)),
        "fp8": ("F8_E4M3", (8, 32)),
        "int4": ("I32", (8, 4)),
        "unknown": ("BF16", (4,)),
    }
    assert {dtype for dtype, _ in placeholders(SHAPES, {}, "F16").values()} == {"F16"}


def test_a_quantization_config_under_text_config_is_the_models_as_vllm_reads_it() -> None:
    nested = model_scheme({"text_config": {"quantization_config": KIMI_K3_MXFP4}})
    assert nested == scheme_of({"quantization_config": KIMI_K3_MXFP4})
    assert isinstance(nested, Mxfp4PackQuant)
    top = {"quantization_config": TINY_FP8, "text_config": {"quantization_config": KIMI_K3_MXFP4}}
    assert model_scheme(top) == scheme_of(top)
    assert model_scheme({"text_config": {"vocab_size": 8}}) is None
    refused = {"quantization_config": {"quant_method": "awq"}}
    assert scheme_of(refused) is not None and model_scheme(refused) is None


def test_the_variants_of_a_scheme_load_its_stored_tensors_under_the_same_name() -> None:
    """compressed-tensors MXFP4 also loads through vLLM's MXFP4 interface (w13_weight, not
    w13_weight_packed): the same stored tensors, the same fields. fp8 blocks load through
    DeepSeek-V4's method too (e8m0 `x.scale`), told which weights are routed experts."""
    scheme = scheme_of({"quantization_config": TINY_MXFP4_PACK})
    assert type(scheme) is Mxfp4PackQuant
    (moe,) = variants(scheme, [])
    assert type(moe) is Mxfp4PackMoeQuant
    assert (moe.name, moe.group, moe.ignored) == (scheme.name, scheme.group, scheme.ignored)
    fp8 = scheme_of({"quantization_config": TINY_FP8})
    assert isinstance(fp8, BlockQuant)
    (v4,) = variants(fp8, ["layers.0.ffn.experts.0.w1.weight"])
    assert type(v4) is Fp8Mxfp4Quant and (v4.block, v4.ignored) == (fp8.block, fp8.ignored)
    assert v4.is_expert("layers.9.ffn.experts.31.w1.weight")
    assert not v4.is_expert("layers.9.ffn.shared_experts.w1.weight")


def test_rows_as_many_as_the_vocabulary_prefer_vocab_unless_they_are_an_experts() -> None:
    hints = Hints(heads=0, rows=0, vocab=256)
    assert candidates("embed", (256, 64), None, hints)[1].cut is Cut.VOCAB
    expert = candidates("experts.0.w1", (256, 64), 0, hints)
    assert [piece.cut for piece in expert[:2]] == [Cut.REPLICATE, Cut.ROWS]
