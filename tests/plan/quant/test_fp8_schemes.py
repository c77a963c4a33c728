"""fp8 per tensor (`quant_method: fp8` without a block size) and compressed-tensors fp8
(`float-quantized`, by tensor, channel or block): the schemes' reading of config.json,
their parameters planned from headers alone at odd sizes, vLLM's refusals in its words,
and small conversions checked against the source bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from plans import rank_tensors as rank
from plans import tiny_source
from safetensors.torch import load_file, save_file
from schema import SCHEMA

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import TINY_FP8, TINY_FP8_CT, make_tiny_model
from shardprep.errors import PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan.make import make_plan
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.fp8_ct import FloatQuant, float_quant
from shardprep.plan.quant.fp8_tensor import TensorQuant
from shardprep.plan.records import SourceModel

MOE = "Qwen3MoeForCausalLM"
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
EXPERTS = "model.layers.1.mlp.experts."
ROUTED = EXPERTS + "routed_experts."


def ct(strategy: str, inputs: dict[str, Any] | None = None, **weights: Any) -> dict:
    """TINY_FP8_CT with the weights' strategy (and `weights`) and activations changed."""
    group = dict(TINY_FP8_CT["config_groups"]["group_0"])
    group["weights"] = {**group["weights"], "strategy": strategy, **weights}
    if inputs is not None:
        group["input_activations"] = {**group["input_activations"], **inputs}
    return {**TINY_FP8_CT, "config_groups": {"group_0": group}}


def source(architecture: str, quant: dict, **overrides: Any) -> SourceModel:
    return tiny_source(architecture, quantization_config=quant, **overrides)


def test_the_schemes_read_config_json() -> None:
    assert scheme_of({"quantization_config": PER_TENSOR}) == TensorQuant(static=True)
    dynamic = scheme_of({"quantization_config": {"quant_method": "fp8", "ignored_layers": ["x"]}})
    assert dynamic == TensorQuant(ignored=frozenset({"x"}))
    odd = scheme_of({"quantization_config": {**PER_TENSOR, "activation_scheme": "token"}})
    assert odd is not None and "activation_scheme 'token'" in odd.problem
    assert scheme_of({"quantization_config": TINY_FP8}).name == "fp8_block"  # type: ignore[union-attr]
    channel = scheme_of({"quantization_config": TINY_FP8_CT})
    assert channel == FloatQuant("channel", ignored=("lm_head", "re:.*mlp.gate$"))
    block = float_quant(
        ct("block", {"strategy": "group", "group_size": 128}, block_structure=[128, 64])
    )
    assert (block.strategy, block.block, block.static, block.problem) == (
        "block",
        (128, 64),
        False,
        "",
    )
    static = float_quant(ct("tensor", {"strategy": "tensor", "dynamic": False}))
    assert static.static and static.describe == "fp8 per tensor, static activation scales"


@pytest.mark.parametrize(
    ("quant", "why"),
    [
        (ct("channel", num_bits=4), "weights num_bits 4"),
        (ct("group"), "weights strategy 'group'"),
        (ct("channel", dynamic=True), "dynamic weights"),
        (ct("block"), "weights block_structure None"),
        (
            ct("channel", {"strategy": "token", "dynamic": False}),
            "static input_activations by 'token'",
        ),
        ({**TINY_FP8_CT, "kv_cache_scheme": {"num_bits": 8}}, "a kv_cache_scheme"),
    ],
)
def test_compressed_tensors_fp8_that_vllm_reads_otherwise_is_refused(quant: dict, why: str) -> None:
    problem = float_quant(quant).problem
    assert problem.startswith(f"quantization_config is compressed-tensors with {why}; "), problem
    assert "float-quantized fp8" in problem


def test_weight_only_fp8_is_refused() -> None:
    quant = {**TINY_FP8_CT, "config_groups": {"group_0": {
        **TINY_FP8_CT["config_groups"]["group_0"], "input_activations": None}}}  # fmt: skip
    assert "no input_activations (fp8 weights only, W8A16)" in float_quant(quant).problem


def test_per_tensor_scales_one_per_part_at_an_odd_tp() -> None:
    """tp3: every part of a fused layer has one scale on every rank."""
    model = source(MOE, PER_TENSOR, num_hidden_layers=2, num_key_value_heads=3, vocab_size=960,
                   num_attention_heads=6, head_dim=16, moe_intermediate_size=48)  # fmt: skip
    assert model.tensors[EXPERTS + "3.up_proj.weight_scale"] == ("F32", ())
    assert model.tensors["model.layers.0.self_attn.k_proj.input_scale"] == ("F32", ())
    plan = make_plan(model, ConversionRequest(tp=3, pp=1))
    ours = rank(plan, 0, 2)
    for layer, parts in (("self_attn.qkv_proj", 3), ("self_attn.o_proj", 1), ("mlp.gate", 1)):
        for kind in ("weight_scale", "input_scale"):
            tensor = ours[f"model.layers.0.{layer}.{kind}"]
            assert (tensor.dtype, tensor.shape) == ("F32", (parts,)), (layer, kind)
    assert ours["model.layers.0.self_attn.qkv_proj.weight"].dtype == "F8_E4M3"
    assert ours[ROUTED + "w13_weight_scale"].shape == (8, 2)
    assert ours[ROUTED + "w2_weight_scale"].shape == (8,)
    assert ours[ROUTED + "w13_input_scale"].shape == (8,)
    w13 = [b.source for b in ours[ROUTED + "w13_input_scale"].blocks]
    assert w13[:2] == [EXPERTS + "0.up_proj.input_scale", EXPERTS + "1.up_proj.input_scale"]
    skipped = dict(plan.models[0].skipped)
    assert "vLLM keeps one of gate and up" in skipped[EXPERTS + "5.gate_proj.input_scale"]


def test_channel_scales_follow_their_weights_rows() -> None:
    model = source(MOE, TINY_FP8_CT, num_hidden_layers=2, num_key_value_heads=1, vocab_size=960,
                   num_attention_heads=3, head_dim=16, moe_intermediate_size=48)  # fmt: skip
    assert model.tensors[EXPERTS + "0.down_proj.weight_scale"] == ("BF16", (128, 1))
    plan = make_plan(model, ConversionRequest(tp=3, pp=1))  # one KV head at tp3: replicated
    ours = rank(plan, 0, 1)
    qkv = ours["model.layers.0.self_attn.qkv_proj.weight_scale"]
    assert (qkv.dtype, qkv.shape) == ("F32", (16 + 16 + 16, 1))
    assert [b.rows for b in qkv.blocks] == [(16, 32), (0, 16), (0, 16)]
    assert ours["model.layers.0.self_attn.o_proj.weight_scale"].shape == (128, 1)  # whole
    assert ours[ROUTED + "w13_weight_scale"].shape == (8, 32, 1)
    assert ours[ROUTED + "w2_weight_scale"].shape == (8, 128, 1)
    # the ignore list leaves the routers and lm_head in the model's dtype
    assert ours["model.layers.0.mlp.gate.weight"].dtype == "BF16"
    assert "model.layers.0.mlp.gate.weight_scale" not in ours


def test_block_scales_and_vllms_refusal_with_the_tps_that_work() -> None:
    quant = ct("block", {"strategy": "group", "group_size": 128}, block_structure=[128, 128])
    dims = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2}  # fmt: skip
    model = source(MOE, quant, moe_intermediate_size=256, **dims)
    ours = rank(make_plan(model, ConversionRequest(tp=2, pp=1)), 0, 1)
    assert ours["model.layers.0.self_attn.qkv_proj.weight_scale"].shape == (4, 2)
    assert ours[ROUTED + "w13_weight_scale"].shape == (8, 2, 2)
    assert ours[ROUTED + "w2_weight_scale"].shape == (8, 2, 1)
    # 64 rows of the experts a rank at tp4: compressed-tensors does not refine the blocks
    model = source(MOE, quant, moe_intermediate_size=256, **dims | {"num_key_value_heads": 4})
    with pytest.raises(PlanError) as caught:
        make_plan(model, ConversionRequest(tp=4, pp=1))
    assert str(caught.value).startswith(
        "cannot convert: target: vLLM refuses fp8 blocks [128, 128] at tp=4: "
    )
    assert (
        "The output_size of gate's and up's weight = 64 is not divisible by weight "
        "quantization block_n = 128." in str(caught.value)
    )
    assert str(caught.value).endswith("Choose a tp that works: 1, 2")


def test_fp8_moes_that_vllm_refuses() -> None:
    tensor_token = ct("tensor")  # per-tensor weights, per-token activations
    model = source(MOE, tensor_token, num_hidden_layers=2)
    with pytest.raises(PlanError, match="per-tensor weights need per-tensor activations"):
        make_plan(model, ConversionRequest(tp=2, pp=1))
    assert make_plan(
        source("Qwen3ForCausalLM", tensor_token, num_hidden_layers=2), ConversionRequest(tp=2, pp=1)
    )


def test_deepseek_v3_fp8_experts_vllm_cannot_load_are_refused_at_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """moe_intermediate_size 192 at tp2: vLLM refines the blocks to 32 x 32 but its own
    `_load_w2` then fails (size 3 vs 4), on any device."""
    model = make_tiny_model(
        tmp_path / "model", "DeepseekV3ForCausalLM", num_hidden_layers=2,
        moe_intermediate_size=192, n_shared_experts=4, quantization_config=TINY_FP8,
        hidden_size=256,
    )  # fmt: skip
    assert main(["plan", "--tp", "2", str(model)]) == 1
    err = capsys.readouterr().err
    assert "vLLM refuses fp8 blocks [128, 128] at tp=2" in err
    assert "its loader cannot place the scales of an intermediate size (192)" in err


def test_converted_scales_are_the_source_values(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", MOE, num_hidden_layers=2, quantization_config=PER_TENSOR
    )
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    src = load_file(model / "model.safetensors")
    ours = load_file(out / "shards" / "model-pp-0-tp-1-part-0.safetensors")

    def expert(e: int, name: str) -> torch.Tensor:
        return src[f"{EXPERTS}{e}.{name}"]

    w13 = torch.stack([torch.stack([expert(e, f"{p}_proj.weight_scale") for p in ("gate", "up")])
                       for e in range(8)])  # fmt: skip
    assert torch.equal(ours[ROUTED + "w13_weight_scale"], w13)
    assert torch.equal(
        ours[ROUTED + "w2_input_scale"],
        torch.stack([expert(e, "down_proj.input_scale") for e in range(8)]),
    )
    attn = "model.layers.0.self_attn."
    qkv = torch.stack([src[f"{attn}{p}_proj.weight_scale"] for p in "qkv"])
    assert torch.equal(ours[attn + "qkv_proj.weight_scale"], qkv)
    assert ours[attn + "o_proj.input_scale"].shape == (1,)
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0
    manifest = json.loads((out / "shardprep.json").read_text())
    jsonschema.validate(manifest, SCHEMA)
    assert manifest["vllm_layout"]["revisions"]["fp8_tensor"] == 1


def test_converted_channel_scales_are_the_source_rows(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", MOE, num_hidden_layers=2, quantization_config=TINY_FP8_CT,
        torch_dtype="bfloat16",
    )  # fmt: skip
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    src = load_file(model / "model.safetensors")
    ours = load_file(out / "shards" / "model-pp-0-tp-1-part-0.safetensors")
    half = src[EXPERTS + "0.gate_proj.weight_scale"].shape[0] // 2
    w13 = torch.stack([
        torch.cat([src[f"{EXPERTS}{e}.{p}_proj.weight_scale"][half:] for p in ("gate", "up")])
        for e in range(8)
    ]).float()  # fmt: skip
    assert torch.equal(ours[ROUTED + "w13_weight_scale"], w13)
    w2 = torch.stack([src[f"{EXPERTS}{e}.down_proj.weight_scale"] for e in range(8)]).float()
    assert torch.equal(ours[ROUTED + "w2_weight_scale"], w2)
    manifest = json.loads((out / "shardprep.json").read_text())
    assert manifest["vllm_layout"]["revisions"]["fp8_ct"] == 1
    report = verify(out, full=True, progress=False)
    assert not report.problems


def test_cli_plan_shows_the_quantization_of_each_parameter_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(
        tmp_path / "model", MOE, num_hidden_layers=2, quantization_config=TINY_FP8_CT
    )
    assert main(["plan", "--tp", "2", str(model)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  quantization: compressed-tensors (fp8_ct)" in out
    assert (
        "    model.layers.*.self_attn.qkv_proj: weight F8_E4M3 [128, 128], "
        "weight_scale F32 [128, 1]"
    ) in out
    experts = [line for line in out if line.startswith("    model.layers.*.mlp.experts.")]
    assert experts == [
        "    model.layers.*.mlp.experts.routed_experts: w13_weight F8_E4M3 [8, 64, 128], "
        "w13_weight_scale F32 [8, 64, 1], w2_weight F8_E4M3 [8, 128, 32], "
        "w2_weight_scale F32 [8, 128, 1]"
    ]
    assert not [line for line in out if line.startswith("    model.layers.*.mlp.gate:")]
    assert main(["plan", "--tp", "2", "--json", str(model)]) == 0
    summary = json.loads(capsys.readouterr().out)
    groups = summary["models"][0]["quantized"]
    assert groups["model.layers.*.self_attn.o_proj"]["weight_scale"] == "F32 [128, 1]"


def add_kv_cache_scales(model: Path) -> dict[str, torch.Tensor]:
    """KV-cache scales in the checkpoint of `model`, in the namings vLLM maps: AutoFP8's
    `self_attn.{k,v}_scale` (layer 0, scalars) and ModelOpt's `{k,v}_proj.{k,v}_scale`
    (layer 1, [1]); returns them."""
    tensors = load_file(model / "model.safetensors")
    added = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([0.75]),
        "model.layers.1.self_attn.v_proj.v_scale": torch.tensor([1.25]),
    }
    save_file(tensors | added, model / "model.safetensors", metadata={"format": "pt"})
    return added


def test_kv_cache_scales_a_checkpoint_ships_go_where_vllm_loads_them(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", "Qwen3ForCausalLM", num_hidden_layers=2, quantization_config=PER_TENSOR
    )
    added = add_kv_cache_scales(model)
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=2), progress=False)
    for stage, layer, names in (
        (0, 0, ("k_scale", "v_scale")),
        (1, 1, ("k_proj.k_scale", "v_proj.v_scale")),
    ):
        for tp in range(2):
            ours = load_file(out / "shards" / f"model-pp-{stage}-tp-{tp}-part-0.safetensors")
            for kind, name in zip(("k", "v"), names, strict=True):
                value = ours[f"model.layers.{layer}.self_attn.attn.{kind}_scale"]
                source = added[f"model.layers.{layer}.self_attn.{name}"]
                model_dtype = ours[f"model.layers.{layer}.input_layernorm.weight"].dtype
                assert value.shape == () and value.dtype == model_dtype
                assert float(value) == float(source.reshape(()))
    report = verify(out, full=True, progress=False)
    assert not report.problems
    jsonschema.validate(json.loads((out / "shardprep.json").read_text()), SCHEMA)


def test_kv_cache_scales_of_a_family_that_has_no_place_for_them_are_refused() -> None:
    """DeepSeek's attention is MLA, whose scales vLLM does not read from `self_attn.attn`."""
    model = source("DeepseekV3ForCausalLM", TINY_FP8, num_hidden_layers=2, hidden_size=256,
                   moe_intermediate_size=128, n_shared_experts=2)  # fmt: skip
    tensors = dict(model.tensors) | {"model.layers.0.self_attn.k_scale": ("F32", ())}
    with pytest.raises(PlanError, match="does not know where to put: model.layers.0.self_attn.k"):
        make_plan(SourceModel(model.config, tensors), ConversionRequest(tp=2, pp=1))
    dims = {"hidden_size": 256, "head_dim": 128, "intermediate_size": 512}
    qwen3 = source("Qwen3ForCausalLM", TINY_FP8, num_hidden_layers=2, **dims)
    tensors = dict(qwen3.tensors) | {"model.layers.1.self_attn.qkv_proj.k_scale": ("F32", (1,))}
    ours = rank(make_plan(SourceModel(qwen3.config, tensors), ConversionRequest(tp=2, pp=2)), 1, 0)
    assert (
        ours["model.layers.1.self_attn.attn.k_scale"].shape,
        ours["model.layers.1.self_attn.attn.k_scale"].dtype,
    ) == ((), "BF16")
