"""DeepSeek-V4 (`DeepseekV4ForCausalLM`) planned without vLLM: in bfloat16, the rules of
vLLM's `load_weights` for the native naming (fused `wq_a`/`wkv` and compressor
`wkv`/`wgate`, `attn_sink` split by heads, `wo_a` by output groups, float32
hyper-connections on every stage, the hash-routed layers' int32 `tid2eid`), the published
config.json of deepseek-ai/DeepSeek-V4-Flash (tests/data/deepseek-v4-flash) at the
topologies it is served with, refusals, and what a tiny checkpoint's conversion writes; as
published (fp8 blocks with e8m0 `.scale`, MXFP4 experts), its plan and refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import DEEPSEEK_V4_FP8, make_tiny_model, tiny_config
from shardprep.errors import PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel, TensorPlan

DATA = Path(__file__).resolve().parents[3] / "data" / "deepseek-v4-flash"
V4 = "DeepseekV4ForCausalLM"


def tensors_of(config: dict[str, Any], *, draft: bool = False) -> dict[str, tuple[str, tuple]]:
    families = [archs.target_family(config)[1]]
    if draft:
        families.append(archs.draft_family("dspark", "deepseek_v4"))
    found = {}
    for family in families:
        dtypes = family.source_dtypes(config)
        found |= {n: (dtypes.get(n, "BF16"), s) for n, s in family.expected_shapes(config).items()}
    return found


@pytest.fixture(scope="module")
def published_config() -> dict[str, Any]:
    return json.loads((DATA / "config.json").read_text())


@pytest.fixture(scope="module")
def bf16(published_config: dict[str, Any]) -> SourceModel:
    """The published sizes in bfloat16 (no quantization_config), with the DSpark stages."""
    config = {k: v for k, v in published_config.items() if k != "quantization_config"}
    return SourceModel(config, tensors_of(config, draft=True))


@pytest.fixture(scope="module")
def published_plan(bf16: SourceModel) -> Plan:
    """The one topology of the published config planned in the suite (tp8 x pp4 and tp16
    are timed by scripts/bench_plan.py), with the built-in DSpark draft."""
    return make_plan(bf16, ConversionRequest(tp=8, pp=2, draft_method="dspark"), bf16)


def source(**overrides: Any) -> SourceModel:
    config = tiny_config(V4, **overrides)
    return SourceModel(config, tensors_of(config))


def rank(plan: Plan, pp: int, tp: int, role: str = "target") -> dict[str, TensorPlan]:
    return {
        t.name: t for f in plan.files if (f.role, f.pp, f.tp) == (role, pp, tp) for t in f.tensors
    }


def test_the_published_config_implies_the_native_names(published_config: dict) -> None:
    family = archs.target_family(published_config)[1]
    assert family.name == "deepseek_v4"
    # dspark_target_layer_ids: the mtp.* stages are the DSpark draft vLLM serves
    assert archs.internal_draft_method(published_config) == "dspark"
    shapes, dtypes = tensors_of(published_config), family.source_dtypes(published_config)
    # 43 layers: 21 of compress ratio 4 (compressor and indexer), 20 of 128, 2 sliding-window.
    assert len([n for n in shapes if n.endswith(".indexer.wq_b.weight")]) == 21
    assert len([n for n in shapes if n.endswith(".attn.compressor.ape")]) == 41
    assert shapes["layers.2.attn.compressor.ape"] == ("F32", (4, 1024))
    assert shapes["layers.3.attn.compressor.ape"] == ("F32", (128, 512))
    assert shapes["layers.2.attn.indexer.compressor.wkv.weight"] == ("BF16", (256, 4096))
    assert shapes["layers.0.attn.wo_a.weight"] == ("BF16", (8192, 4096))
    assert shapes["layers.0.hc_attn_fn"] == ("F32", (24, 16384))
    assert shapes["hc_head_fn"] == ("F32", (4, 16384))
    # The first num_hash_layers layers route by token id; the others have a routing bias.
    assert dtypes["layers.2.ffn.gate.tid2eid"] == "I32"
    assert shapes["layers.2.ffn.gate.tid2eid"][1] == (129280, 6)
    assert "layers.3.ffn.gate.tid2eid" not in shapes and "layers.2.ffn.gate.bias" not in shapes
    assert dtypes["layers.3.ffn.gate.bias"] == "F32"
    assert len(shapes) == 34223


def quantized_table(config: dict[str, Any]) -> dict[str, tuple[str, tuple]]:
    """The target's tensors as the quantization stores them (fp8 and e8m0 `.scale`, int8
    fp4 pairs), the families' own table."""
    family = archs.target_family(config)[1]
    shapes = quantized.expected_shapes(family, config)
    dtypes = quantized.source_dtypes(family, config)
    return {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()}


@pytest.fixture(scope="module")
def published_fp8(published_config: dict[str, Any]) -> SourceModel:
    """The published fp8 + fp4 checkpoint's target."""
    return SourceModel(published_config, quantized_table(published_config))


@pytest.fixture(scope="module")
def published_fp8_plan(published_fp8: SourceModel) -> Plan:
    """The published fp8 + fp4 checkpoint's target planned at tp8 x pp2 (its DSpark
    stages left out, as --no-mtp does)."""
    return make_plan(published_fp8, ConversionRequest(tp=8, pp=2))


def test_the_published_fp8_and_fp4_checkpoint_plans_at_tp8_pp2(
    published_fp8: SourceModel, published_fp8_plan: Plan
) -> None:
    table = published_fp8.tensors
    a, f = "layers.2.attn.", "layers.2.ffn."
    assert table[a + "wo_a.weight"] == ("F8_E4M3", (8192, 4096))
    assert table[a + "wo_a.scale"] == ("F8_E8M0", (64, 32))  # one per 128 x 128 block
    assert table[a + "indexer.wq_b.scale"] == ("F8_E8M0", (64, 8))
    assert table[f + "experts.7.w2.weight"] == ("I8", (4096, 1024))  # two e2m1 a byte
    assert table[f + "experts.7.w2.scale"] == ("F8_E8M0", (4096, 64))  # one per 32
    for plain in ("compressor.wkv.weight", "indexer.weights_proj.weight"):
        assert table[a + plain][0] == "BF16"
    assert table[f + "gate.weight"][0] == table["head.weight"][0] == "BF16"
    model = published_fp8_plan.models[0]
    assert (model.quantization, model.scheme) == ("deepseek_v4_fp8", "fp8_e8m0_mxfp4")
    first = rank(published_fp8_plan, 0, 7)
    m = "model." + a
    assert first[m + "fused_wqa_wkv.weight"].dtype == "F8_E4M3"
    scale = first[m + "fused_wqa_wkv.weight_scale_inv"]  # 8 + 4 blocks of rows
    assert (scale.dtype, scale.shape) == ("F8_E8M0", (12, 32))
    assert [b.source for b in scale.blocks] == [a + "wq_a.scale", a + "wkv.scale"]
    assert first[m + "wo_a.weight_scale_inv"].shape == (64 // 8, 32)
    assert first[m + "wo_b.weight_scale_inv"].shape == (32, 64 // 8)
    assert first[m + "compressor.fused_wkv_wgate.weight"].dtype == "BF16"
    stacks = "model." + f + "experts.routed_experts."
    w13, w13_scale = first[stacks + "w13_weight"], first[stacks + "w13_weight_scale"]
    assert (w13.dtype, w13.shape) == ("U8", (256, 2 * 2048 // 8, 4096 // 2))
    assert (w13_scale.dtype, w13_scale.shape) == ("U8", (256, 2 * 2048 // 8, 4096 // 32))
    assert first[stacks + "w2_weight"].shape == (256, 4096, 2048 // 8 // 2)
    down = first["model." + f + "shared_experts.down_proj.weight_scale_inv"]
    assert (down.dtype, down.shape) == ("F8_E8M0", (32, 2))
    last = rank(published_fp8_plan, 1, 0)
    assert last["lm_head.weight"].dtype == "BF16"
    assert max(int(n.split(".")[2]) for n in last if n.startswith("model.layers.")) == 42


def test_the_published_draft_of_a_quantized_checkpoint_is_refused(
    published_fp8: SourceModel,
) -> None:
    model = published_fp8
    with pytest.raises(PlanError, match=r"mtp\.\*\) of a quantized DeepSeek-V4 .* --no-mtp"):
        make_plan(model, ConversionRequest(tp=8, pp=2, draft_method="dspark"), model)


def test_fp8_experts_are_refused_in_one_line(published_fp8: SourceModel) -> None:
    config = dict(published_fp8.config, expert_dtype="fp8")  # DeepSeek-V4-Flash-Base
    with pytest.raises(PlanError) as info:
        make_plan(SourceModel(config, published_fp8.tensors), ConversionRequest(tp=8, pp=2))
    assert str(info.value) == (
        "cannot convert: target: DeepSeek-V4 with expert_dtype 'fp8' (fp8 block experts) is "
        "not supported yet; shardprep converts the published fp8 + fp4 checkpoint "
        "(expert_dtype fp4)"
    )


def test_sizes_vllm_refuses_are_refused_and_sizes_a_backend_pads_plan() -> None:
    config = tiny_config(V4, quantization_config=DEEPSEEK_V4_FP8, expert_dtype="fp4")
    with pytest.raises(PlanError) as info:  # q_lora_rank 64: not whole blocks of 128
        make_plan(SourceModel(config, quantized_table(config)), ConversionRequest(tp=1, pp=1))
    assert "layers.*.attn.fused_wqa_wkv: Weight output_partition_size = 64" in str(info.value)
    sizes = {"q_lora_rank": 128, "o_lora_rank": 512, "o_groups": 4, "num_attention_heads": 8}
    config = tiny_config(V4, quantization_config=DEEPSEEK_V4_FP8, expert_dtype="fp4", **sizes)
    config |= {"moe_intermediate_size": 128, "n_shared_experts": 4}
    # 64 expert rows a rank, which most backends pad: stored unpadded, padded at load
    plan = make_plan(SourceModel(config, quantized_table(config)), ConversionRequest(tp=2, pp=1))
    w13 = rank(plan, 0, 1)["model.layers.0.ffn.experts.routed_experts.w13_weight"]
    assert w13.shape[1] == 2 * 64


def test_deepseek_v4_plans_at_tp8_pp2(published_plan: Plan) -> None:
    plan, tp, pp = published_plan, 8, 2
    assert [m.family for m in plan.models] == ["deepseek_v4", "deepseek_v4_dspark"]
    skipped = dict(plan.models[0].skipped)
    assert skipped["mtp.0.main_proj.weight"] == (
        "a tensor of the DSpark draft, written to the draft's files"
    )
    first, last = rank(plan, 0, tp - 1), rank(plan, pp - 1, 0)
    a = "model.layers.2.attn."
    assert first[a + "fused_wqa_wkv.weight"].shape == (1024 + 512, 4096)
    assert [b.source for b in first[a + "fused_wqa_wkv.weight"].blocks] == [
        "layers.2.attn.wq_a.weight",
        "layers.2.attn.wkv.weight",
    ]
    assert first[a + "wq_b.weight"].shape == (64 * 512 // tp, 1024)
    assert first[a + "wo_a.weight"].shape == (8 * 1024 // tp, 4096)
    assert first[a + "wo_b.weight"].shape == (4096, 8 * 1024 // tp)
    assert (first[a + "attn_sink"].dtype, first[a + "attn_sink"].shape) == ("F32", (64 // tp,))
    sink = first[a + "attn_sink"].blocks[0]
    assert sink.rows == ((tp - 1) * 64 // tp, 64)  # the last rank's heads
    assert first[a + "compressor.fused_wkv_wgate.weight"].shape == (2048, 4096)
    assert first["model.layers.3.attn.compressor.fused_wkv_wgate.weight"].shape == (1024, 4096)
    assert first[a + "indexer.wq_b.weight"].shape == (64 * 128, 1024)
    assert first[a + "indexer.compressor.fused_wkv_wgate.weight"].shape == (512, 4096)
    assert first[a + "indexer.compressor.ape"].dtype == "F32"
    assert "model.layers.0.attn.compressor.ape" not in first  # a sliding-window layer
    f = "model.layers.2.ffn."
    assert (first[f + "gate.tid2eid"].dtype, first[f + "gate.tid2eid"].shape) == (
        "I32",
        (129280, 6),
    )
    bias = first["model.layers.3.ffn.gate.e_score_correction_bias"]
    assert (bias.dtype, bias.shape) == ("F32", (256,))
    assert first[f + "experts.routed_experts.w13_weight"].shape == (256, 2 * 2048 // tp, 4096)
    assert first[f + "experts.routed_experts.w2_weight"].shape == (256, 4096, 2048 // tp)
    assert first[f + "shared_experts.gate_up_proj.weight"].shape == (2 * 2048 // tp, 4096)
    assert first[f + "shared_experts.down_proj.weight"].shape == (4096, 2048 // tp)
    assert first["model.layers.2.hc_ffn_fn"].dtype == "F32"
    assert first["model.embed_tokens.weight"].shape == (129280 // tp, 4096)
    for stage in range(pp):  # the hyper-connection head is built on every stage
        held = rank(plan, stage, 0)
        assert held["model.hc_head_fn"].shape == (4, 16384)
        assert ("lm_head.weight" in held) == ("model.norm.weight" in held) == (stage == pp - 1)
    # with the DSpark draft at pp > 1, vLLM's NVIDIA target also builds (and loads) the
    # embedding on the last stage, for the draft to share; only when a draft runs
    assert last["model.embed_tokens.weight"].shape == (129280 // tp, 4096)
    assert ("model.embed_tokens.weight", 1) in plan.models[0].spec_decode_only
    layers = {int(n.split(".")[2]) for n in last if n.startswith("model.layers.")}
    assert max(layers) == 42


def test_the_published_draft_plans_on_the_last_stage(published_plan: Plan) -> None:
    """DeepSeek-V4-Flash's config.json (bfloat16 sizes): three DSpark stages (no
    n_mtp_layers, so vLLM's default), main_proj over the three target layers 40-42, the
    heads in stage 2; the draft on stage 1 only."""
    plan = published_plan
    assert [(m.role, m.family) for m in plan.models] == [
        ("target", "deepseek_v4"),
        ("draft", "deepseek_v4_dspark"),
    ]
    assert {f.pp for f in plan.files if f.role == "draft"} == {1}
    held = rank(plan, 1, 7, role="draft")
    assert held["model.main_proj.weight"].shape == (4096, 3 * 4096)
    assert held["model.context_wkv_proj.weight"].shape == (3 * 512, 4096)
    assert [b.source for b in held["model.context_wkv_proj.weight"].blocks] == [
        f"mtp.{i}.attn.wkv.weight" for i in range(3)
    ]
    assert held["model.markov_head.markov_w2.weight"].shape == (129280, 256)
    assert held["model.confidence_head.proj.weight"].shape == (1, 4096 + 256)
    a = "model.layers.2.attn."
    assert held[a + "attn_sink"].shape == (8,) and held[a + "attn_sink"].blocks[0].rows == (56, 64)
    assert held[a + "fused_wqa_wkv.weight"].shape == (1024 + 512, 4096)
    assert held[a + "wo_a.weight"].shape == (1024, 4096)
    f = "model.layers.2.ffn."
    assert held[f + "experts.routed_experts.w13_weight"].shape == (256, 2 * 2048 // 8, 4096)
    assert held[f + "gate.e_score_correction_bias"].dtype == "F32"
    assert not any(".compressor." in n for n in held)


def test_tp16_is_refused_because_the_output_groups_do_not_divide(bf16: SourceModel) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(bf16, ConversionRequest(tp=16, pp=1))
    assert str(info.value) == (
        "cannot convert: target: o_groups (8) is not divisible by tp=16; choose a tp that "
        "divides it"
    )


def test_a_tp_that_does_not_divide_is_refused_with_every_reason() -> None:
    with pytest.raises(PlanError) as info:
        make_plan(
            source(num_hidden_layers=2, o_groups=6, num_attention_heads=6),
            ConversionRequest(tp=4, pp=1),
        )
    message = str(info.value)
    assert "num_attention_heads (6) is not divisible by tp=4" in message
    assert "o_groups (6) is not divisible by tp=4" in message
    assert "moe_intermediate_size" not in message
    with pytest.raises(PlanError, match=r"n_routed_experts \(4\) is not divisible by tp=3"):
        make_plan(
            source(num_hidden_layers=2, o_groups=3, num_attention_heads=3),
            ConversionRequest(tp=3, pp=1),
        )


@pytest.mark.parametrize(("tp", "pp", "layers"), [(3, 2, 3), (1, 3, 5), (6, 1, 2)])
def test_odd_sizes_cut_every_rule(tp: int, pp: int, layers: int) -> None:
    ratios = [4, 128, 0, 4, 128][:layers]
    model = source(
        num_hidden_layers=layers, compress_ratios=ratios, num_attention_heads=6, o_groups=6,
        n_routed_experts=6, moe_intermediate_size=96, num_hash_layers=2, vocab_size=960,
    )  # fmt: skip
    plan = make_plan(model, ConversionRequest(tp=tp, pp=pp))
    for stage in range(pp):
        for t in range(tp):
            held = rank(plan, stage, t)
            assert held["model.hc_head_base"].shape == (4,)
            for name, tensor in held.items():
                if name.endswith("attn.attn_sink"):
                    assert tensor.shape == (6 // tp,)
                    assert tensor.blocks[0].rows == (t * 6 // tp, (t + 1) * 6 // tp)
                if name.endswith("attn.wo_a.weight"):
                    assert tensor.shape == (6 * 64 // tp, 512)
                if name.endswith("routed_experts.w13_weight"):
                    assert tensor.shape == (6, 2 * 96 // tp, 256)
    built = {n.split(".")[2] for p in range(pp) for n in rank(plan, p, 0) if "tid2eid" in n}
    assert built == {"0", "1"} & {str(i) for i in range(layers)}


def test_a_tiny_checkpoint_converts_to_what_vllm_loads(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", V4)
    stored = load_file(model / "model.safetensors")
    assert stored["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert int(stored["layers.0.ffn.gate.tid2eid"].max()) < 4  # valid expert ids
    convert(str(model), tmp_path / "a", Options(tp=2, pp=2), progress=False)
    manifest = read_manifest(tmp_path / "a")
    assert [(m.role, m.architecture) for m in manifest.models] == [
        ("target", V4),
        ("draft", "dspark"),  # the built-in DSpark draft, in draft/
    ]
    seen = set()
    for f in (f for f in manifest.files if f.role == "target"):
        state = load_file(tmp_path / "a" / f.path)
        assert torch.equal(state["model.hc_head_fn"], stored["hc_head_fn"])
        for name, value in state.items():
            if not name.startswith("model.layers."):
                continue
            layer = f"layers.{name.split('.')[2]}."
            if name.endswith("attn.fused_wqa_wkv.weight"):
                parts = [stored[layer + "attn.wq_a.weight"], stored[layer + "attn.wkv.weight"]]
                assert torch.equal(value, torch.cat(parts))
            elif name.endswith("compressor.fused_wkv_wgate.weight"):
                inner = name.split(".attn.")[1].removesuffix("fused_wkv_wgate.weight")
                c = layer + "attn." + inner
                assert torch.equal(
                    value, torch.cat([stored[c + "wkv.weight"], stored[c + "wgate.weight"]])
                )
            elif name.endswith("attn.attn_sink"):
                assert value.dtype == torch.float32
                assert torch.equal(value, stored[layer + "attn.attn_sink"][2 * f.tp : 2 * f.tp + 2])
            else:
                continue
            seen.add(name.split(".", 3)[3])
    assert seen == {
        "attn.fused_wqa_wkv.weight",
        "attn.compressor.fused_wkv_wgate.weight",
        "attn.indexer.compressor.fused_wkv_wgate.weight",
        "attn.attn_sink",
    }
    report = verify(tmp_path / "a", full=True)  # re-planned and compared with the source
    assert report.ok and report.round_trip_tensors == len(stored), report.problems


def test_the_plan_command_names_the_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", V4)
    assert main(["plan", str(model), "--tp", "2", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(m["role"], m["architecture"]) for m in data["models"]] == [
        ("target", V4),
        ("draft", "dspark"),
    ]


def test_a_config_saved_by_transformers_deepseek_v4_config_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """transformers 5's own DeepseekV4Config saves `compress_ratios` as `compress_rates` and
    `num_hash_layers` as `mlp_layer_types`; vLLM reads DeepSeek-V4 with its own config
    class, which knows only the native names, so such a config.json cannot be served."""
    import transformers

    model = make_tiny_model(tmp_path / "m", V4)
    config = json.loads((model / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    transformers.AutoConfig.for_model("deepseek_v4", **kwargs).save_pretrained(model)
    saved = json.loads((model / "config.json").read_text())
    assert "compress_rates" in saved and "compress_ratios" not in saved
    with pytest.raises(PlanError) as info:
        convert(str(model), tmp_path / "a", Options(tp=2, pp=1), progress=False)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith(
        "config.json has no compress_ratios nor num_hash_layers, which vLLM reads for "
        "DeepSeek-V4 (a config saved by transformers' DeepseekV4Config holds compress_rates "
        "and mlp_layer_types instead); use the checkpoint's native config.json"
    )
