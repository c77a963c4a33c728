"""DeepSeek-V2/V3 and fp8 block scales, planned from headers alone (no vLLM, no bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from plans import rank_tensors as rank
from plans import tiny_source as source
from schema import SCHEMA

from shardprep.cli import main
from shardprep.demo.tiny import TINY_FP8, make_tiny_model
from shardprep.errors import PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"


def test_v3_mla_fuses_q_a_and_kv_a_and_splits_heads() -> None:
    plan = make_plan(source(V3, num_hidden_layers=3), ConversionRequest(tp=2, pp=2))
    first, last = rank(plan, 0, 1), rank(plan, 1, 1)
    fused = first["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert fused.shape == (128 + 512 + 64, 128)
    assert [b.source for b in fused.blocks] == [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    ]
    assert first["model.layers.0.self_attn.q_b_proj.weight"].blocks[0].rows == (256, 512)
    assert first["model.layers.0.self_attn.o_proj.weight"].blocks[0].cols == (128, 256)
    # Layer 0 is dense (first_k_dense_replace=1); layer 1 has the router and shared experts.
    assert first["model.layers.0.mlp.gate_up_proj.weight"].shape == (256, 128)
    assert first["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape == (256, 128)
    assert first["model.layers.1.mlp.gate.weight"].shape == (8, 128)
    # The routing bias stays float32 in a bfloat16 model.
    assert first["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert first["model.layers.1.mlp.gate.weight"].dtype == "BF16"
    # Embedding on the first stage only; norm and lm_head on the last.
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    assert {"model.norm.weight", "lm_head.weight"} <= set(last) - set(first)


def test_v2_without_q_lora_splits_q_proj_and_replicates_kv_a() -> None:
    plan = make_plan(source(V2, num_hidden_layers=2), ConversionRequest(tp=2, pp=1))
    ours = rank(plan, 0, 1)
    assert ours["model.layers.0.self_attn.q_proj.weight"].blocks[0].rows == (256, 512)
    kv_a = ours["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape == (576, 128) and kv_a.blocks[0].rows == (0, 576)
    assert not any("fused_qkv_a_proj" in name or "e_score" in name for name in ours)


def test_mtp_layers_are_skipped_by_name() -> None:
    model = source(V3, num_hidden_layers=2)
    tensors = dict(model.tensors)
    tensors["model.layers.2.enorm.weight"] = ("BF16", (128,))
    plan = make_plan(SourceModel(model.config, tensors), ConversionRequest(tp=1, pp=1))
    (target,) = plan.models
    assert dict(target.skipped)["model.layers.2.enorm.weight"].startswith("an MTP layer")


def test_fp8_weights_stay_fp8_with_float32_block_scales() -> None:
    plan = make_plan(
        source(V3, num_hidden_layers=2, quantization_config=TINY_FP8), ConversionRequest(tp=2, pp=1)
    )
    ours = rank(plan, 0, 1)
    prefix = "model.layers.0.self_attn."
    assert ours[prefix + "fused_qkv_a_proj.weight"].dtype == "F8_E4M3"
    # [q_lora 128 ; kv_lora + rope 576] rows in 128-blocks: 1 + 5 scale rows (last partial).
    fused = ours[prefix + "fused_qkv_a_proj.weight_scale_inv"]
    assert (fused.dtype, fused.shape) == ("F32", (6, 1))
    assert ours[prefix + "q_b_proj.weight_scale_inv"].blocks[0].rows == (2, 4)
    assert ours[prefix + "o_proj.weight_scale_inv"].blocks[0].cols == (1, 2)
    assert ours["model.layers.0.input_layernorm.weight"].dtype == "BF16"


def test_a_tp_the_blocks_forbid_is_refused_with_vllms_reason() -> None:
    model = source(V3, num_hidden_layers=2, quantization_config=TINY_FP8)
    with pytest.raises(PlanError) as info:
        make_plan(model, ConversionRequest(tp=4, pp=1))
    assert str(info.value) == (
        "cannot convert: target: vLLM refuses fp8 blocks [128, 128] at tp=4: "
        "model.layers.*.self_attn.o_proj: Weight input_size_per_partition = 64 is not "
        "divisible by weight quantization block_k = 128. (and 4 more layers) "
        "Choose a tp that works: 1, 2"
    )


def test_experts_too_fine_to_refine_are_refused_as_vllm_does() -> None:
    """vLLM refines MoE blocks to gcd(128, 128, I/tp, H) when that is at least 32: 384
    expert rows give 192 at tp2 (refined to 64) and 96 at tp4 (32), but only 48 at tp8."""
    config = {"num_attention_heads": 16, "intermediate_size": 2048, "n_shared_experts": 0}
    model = source(
        V3, num_hidden_layers=2, moe_intermediate_size=384, quantization_config=TINY_FP8, **config
    )
    make_plan(model, ConversionRequest(tp=4, pp=1))
    with pytest.raises(PlanError) as info:
        make_plan(model, ConversionRequest(tp=8, pp=1))
    assert str(info.value) == (
        "cannot convert: target: vLLM refuses fp8 blocks [128, 128] at tp=8: "
        "model.layers.*.mlp.experts: The output_size of gate's and up's weight = 48 is not "
        "divisible by weight quantization block_n = 128. Choose a tp that works: 1, 2, 4"
    )


def test_experts_whose_scales_vllm_cannot_place_are_refused() -> None:
    """192 expert rows end inside a 128-block: vLLM refines the blocks at tp2, then its own
    `_load_w2` fails on the upsampled scales (size 3 vs 4), on any device."""
    model = source(
        V3, num_hidden_layers=2, moe_intermediate_size=192, n_shared_experts=4,
        quantization_config=TINY_FP8,
    )  # fmt: skip
    with pytest.raises(PlanError) as info:
        make_plan(model, ConversionRequest(tp=2, pp=1))
    assert str(info.value) == (
        "cannot convert: target: vLLM refuses fp8 blocks [128, 128] at tp=2: "
        "model.layers.*.mlp.experts: vLLM refines the blocks to [32, 32] for experts of 96 "
        "rows per rank, but its loader cannot place the scales of an intermediate size (192) "
        "that is not a whole number of 128-blocks. Choose a tp that works: none"
    )


def test_cli_refuses_a_scale_of_the_wrong_shape_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file, save_file

    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, quantization_config=TINY_FP8
    )
    tensors = load_file(model / "model.safetensors")
    name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1]
    save_file(tensors, model / "model.safetensors")
    out = tmp_path / "out"
    assert main(["convert", "--tp", "2", "--pp", "1", str(model), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"shardprep: error: cannot convert: target: {name} has shape [1, 4] but config.json "
        "implies [4, 4]"
    ]
    assert not out.exists()


def test_refined_moe_scales_are_upsampled_then_cut(tmp_path: Path) -> None:
    """Experts of 128 at tp2 hold 64 rows each, not a whole 128-block: vLLM refines the
    grid to 64 x 64 and upsamples each scale 2 x 2 before cutting (repeat_interleave)."""
    import torch
    from safetensors.torch import load_file

    from shardprep.convert.run import Options, convert
    from shardprep.convert.verify import verify

    refined = {"moe_intermediate_size": 128, "n_shared_experts": 2}
    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, quantization_config=TINY_FP8, **refined
    )
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    source = load_file(model / "model.safetensors")
    ours = load_file(out / "shards" / "model-pp-0-tp-1-part-0.safetensors")

    def up(name: str) -> torch.Tensor:
        return source[name].repeat_interleave(2, 0).repeat_interleave(2, 1)

    experts = "model.layers.1.mlp.experts."
    w13 = torch.stack(
        [
            torch.cat([up(f"{experts}{e}.{p}_proj.weight_scale_inv")[1:2] for p in ("gate", "up")])
            for e in range(8)
        ]
    )
    w2 = torch.stack([up(f"{experts}{e}.down_proj.weight_scale_inv")[:, 1:2] for e in range(8)])
    routed = experts + "routed_experts."
    assert torch.equal(ours[routed + "w13_weight_scale_inv"], w13)
    assert torch.equal(ours[routed + "w2_weight_scale_inv"], w2)
    assert ours[routed + "w13_weight"].dtype == torch.float8_e4m3fn
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0
    jsonschema.validate(json.loads((out / "shardprep.json").read_text()), SCHEMA)


def test_a_config_without_mla_sizes_is_one_clear_problem() -> None:
    model = source(V3, num_hidden_layers=2)
    config = {k: v for k, v in model.config.items() if k != "kv_lora_rank"}
    with pytest.raises(PlanError, match="config.json lacks or garbles 'kv_lora_rank'"):
        make_plan(SourceModel(config, model.tensors), ConversionRequest(tp=2, pp=1))
