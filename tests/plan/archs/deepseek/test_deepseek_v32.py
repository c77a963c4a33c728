"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and its MTP draft, planned without vLLM: the
indexer's rules (`wq_b` replicated and quantized, `wk` and `weights_proj` fused and
replicated, an fp8 `wk` dequantized as vLLM does, `k_norm` float32, no indexer where vLLM
builds none), the published config.json and tensor table of deepseek-ai/DeepSeek-V3.2
(tests/data/deepseek-v3.2) at the topologies it is served with, and what a tiny
checkpoint's conversion writes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from plans import source_model
from safetensors.torch import load_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import TINY_FP8, make_tiny_model, tiny_config
from shardprep.errors import PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel, TensorPlan

DATA = Path(__file__).resolve().parents[3] / "data" / "deepseek-v3.2"
V32 = "DeepseekV32ForCausalLM"
IDX = "self_attn.indexer."
LAYERS = {"{L}": range(62), "{D}": range(3), "{M}": range(3, 62), "{E}": range(256)}


def published_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """The published checkpoint's 92,425 tensors, from the table of its groups."""
    table = json.loads((DATA / "tensors.json").read_text())
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for pattern, (dtype, shape) in table["groups"].items():
        keys = [k for k in LAYERS if k in pattern]
        for values in itertools.product(*(LAYERS[k] for k in keys)):
            name = pattern
            for key, value in zip(keys, values, strict=True):
                name = name.replace(key, str(value))
            found[name] = (dtype, tuple(shape))
    assert len(found) == table["count"]
    return found


@pytest.fixture(scope="module")
def published() -> SourceModel:
    return SourceModel(json.loads((DATA / "config.json").read_text()), published_tensors())


def with_dequantized(model: SourceModel) -> SourceModel:
    """The headers plus the dequantized tensors convert adds (bfloat16, the stored shape)."""
    family = archs.target_family(model.config)[1]
    dtypes = {name: dtype for name, (dtype, _) in model.tensors.items()}
    shapes = {name: shape for name, (_, shape) in model.tensors.items()}
    derived = family.dequantized_sources(model.config, dtypes, shapes)
    added = {name: ("BF16", model.tensors[weight][1]) for name, (weight, _) in derived.items()}
    return SourceModel(model.config, {**model.tensors, **added})


def source(**overrides: Any) -> SourceModel:
    config = tiny_config(V32, **overrides)
    families = [archs.target_family(config)[1]]
    if config.get("num_nextn_predict_layers"):
        families.append(archs.draft_family("mtp", families[0].name))
    return source_model(config, *families)


def rank(plan: Plan, role: str, pp: int, tp: int) -> dict[str, TensorPlan]:
    return {
        t.name: t for f in plan.files if (f.role, f.pp, f.tp) == (role, pp, tp) for t in f.tensors
    }


def test_the_family_implies_the_published_tensors(published: SourceModel) -> None:
    config = published.config
    family = archs.target_family(config)[1]
    assert archs.internal_draft_method(config) == "mtp"
    draft = archs.draft_family("mtp", family.name)
    implied = quantized.expected_shapes(family, config) | quantized.expected_shapes(draft, config)
    dtypes = quantized.source_dtypes(family, config) | quantized.source_dtypes(draft, config)
    assert {n: tuple(s) for n, s in implied.items()} == {
        n: s for n, (_, s) in published.tensors.items()
    }
    # Every quantized weight and scale (the indexer's wq_b and wk too), the float32 routing
    # bias and k_norm, as published.
    assert dtypes == {
        n: d for n, (d, _) in published.tensors.items() if d in ("F8_E4M3",) or n in dtypes
    }
    assert dtypes[f"model.layers.61.{IDX}wk.weight"] == "F8_E4M3"
    assert dtypes[f"model.layers.61.{IDX}k_norm.bias"] == "F32"
    assert dtypes[f"model.layers.0.{IDX}wq_b.weight_scale_inv"] == "F32"


def test_each_fp8_wk_is_dequantized_and_headers_alone_are_refused(
    published: SourceModel,
) -> None:
    family = archs.target_family(published.config)[1]
    dtypes = {name: dtype for name, (dtype, _) in published.tensors.items()}
    shapes = {name: shape for name, (_, shape) in published.tensors.items()}
    derived = family.dequantized_sources(published.config, dtypes, shapes)
    assert len(derived) == 62
    wk = f"model.layers.61.{IDX}wk.weight"
    assert derived[wk + ".dequantized"] == (wk, wk + "_scale_inv")
    with pytest.raises(PlanError) as info:
        make_plan(published, ConversionRequest(tp=8, pp=2, draft_method="mtp"), published)
    assert str(info.value) == (
        "the indexer's wk is stored fp8 with block scales "
        f"(model.layers.0.{IDX}wk.weight, model.layers.1.{IDX}wk.weight, "
        f"model.layers.10.{IDX}wk.weight and 58 more), which vLLM dequantizes while loading; "
        "plan the checkpoint with `shardprep plan` or `convert`, which dequantize it as vLLM "
        "does"
    )


# One topology in the suite (planning a published model takes seconds); tp8 x pp4 and tp16 plan
# with scripts/bench_plan.py --model deepseek-v3.2.
@pytest.mark.parametrize(("tp", "pp"), [(8, 2)])
def test_deepseek_v32_plans_at_the_topologies_it_is_served_with(
    published: SourceModel, tp: int, pp: int
) -> None:
    model = with_dequantized(published)
    plan = make_plan(model, ConversionRequest(tp=tp, pp=pp, draft_method="mtp"), model)
    assert [m.method for m in plan.models] == [None, "mtp"]
    assert [m.family for m in plan.models] == ["deepseek_v32", "deepseek_v32_mtp"]
    assert {(f.role, f.pp) for f in plan.files if f.role == "draft"} == {("draft", pp - 1)}
    first, last = rank(plan, "target", 0, tp - 1), rank(plan, "target", pp - 1, 0)
    layer = "model.layers.0."
    # The indexer: whole on every rank; wq_b fp8 with its scales, wk + weights_proj fused.
    assert (first[layer + IDX + "wq_b.weight"].dtype, first[layer + IDX + "wq_b.weight"].shape) == (
        "F8_E4M3",
        (8192, 1536),
    )
    assert first[layer + IDX + "wq_b.weight_scale_inv"].shape == (64, 12)
    fused = first[layer + IDX + "wk_weights_proj.weight"]
    assert (fused.dtype, fused.shape) == ("BF16", (128 + 64, 7168))
    assert [b.source for b in fused.blocks] == [
        f"{layer}{IDX}wk.weight.dequantized",
        f"{layer}{IDX}weights_proj.weight",
    ]
    for norm in ("k_norm.weight", "k_norm.bias"):
        assert (first[layer + IDX + norm].dtype, first[layer + IDX + norm].shape) == (
            "F32",
            (128,),
        )
    # DeepSeek-V3's MLA and MoE around it, split by tp.
    assert first[layer + "self_attn.q_b_proj.weight"].shape == (24576 // tp, 1536)
    assert first[layer + "self_attn.q_b_proj.weight_scale_inv"].shape == (192 // tp, 12)
    assert first["model.layers.3.mlp.experts.routed_experts.w13_weight"].shape == (
        256,
        2 * 2048 // tp,
        7168,
    )
    assert "lm_head.weight" in last and "model.norm.weight" in last
    layers = {int(n.split(".")[2]) for n in last if n.startswith("model.layers.")}
    assert max(layers) == 60 and "model.layers.61.self_attn.indexer.wq_b.weight" not in last
    draft = rank(plan, "draft", pp - 1, tp - 1)
    block = "model.layers.61.mtp_block."
    assert draft[block + IDX + "wk_weights_proj.weight"].shape == (192, 7168)
    assert draft[block + IDX + "wq_b.weight"].dtype == "F8_E4M3"
    assert draft[block + IDX + "k_norm.bias"].dtype == "F32"
    assert draft["model.layers.61.eh_proj.weight"].dtype == "BF16"
    assert ("model.embed_tokens.weight" in draft) == (pp > 1)


def test_a_tp_that_v32_cannot_use_is_refused_with_every_reason(published: SourceModel) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(with_dequantized(published), ConversionRequest(tp=3, pp=2))
    message = str(info.value)
    assert "num_attention_heads (128) is not divisible by tp=3" in message
    assert "moe_intermediate_size (2048) is not divisible by tp=3" in message


def test_layers_that_reuse_the_top_k_build_no_indexer_but_mtp_layers_do() -> None:
    # vLLM's rule, max(layer - offset + 1, 0) % freq != 0 skips: with index_topk_freq 2
    # and the default offset 2, layer 2 reuses layer 1's top-k.
    model = source(num_hidden_layers=4, num_nextn_predict_layers=1, index_topk_freq=2)
    plan = make_plan(model, ConversionRequest(tp=2, pp=1, draft_method="mtp"), model)
    target = rank(plan, "target", 0, 1)
    built = {i for i in range(4) if f"model.layers.{i}.{IDX}wq_b.weight" in target}
    assert built == {0, 1, 3}
    (entry,) = [m for m in plan.models if m.role == "target"]
    skipped = dict(entry.skipped)
    assert "reuses the previous layer's top-k" in skipped[f"model.layers.2.{IDX}wk.weight"]
    draft = rank(plan, "draft", 0, 0)
    assert f"model.layers.4.mtp_block.{IDX}wk_weights_proj.weight" in draft
    for pattern in ("FSFS", ["F", "S", "F", "S"]):  # a string or a list, as vLLM reads it
        plan = make_plan(
            source(num_hidden_layers=4, index_topk_pattern=pattern), ConversionRequest(tp=1, pp=1)
        )
        target = rank(plan, "target", 0, 0)
        built = {i for i in range(4) if f"model.layers.{i}.{IDX}wq_b.weight" in target}
        assert built == {0, 2}


def test_a_config_without_the_indexer_sizes_is_refused_in_words() -> None:
    model = source(num_hidden_layers=2)
    config = {k: v for k, v in model.config.items() if k != "index_topk"}
    with pytest.raises(PlanError, match="config.json has no index_topk, so vLLM would build"):
        make_plan(SourceModel(config, model.tensors), ConversionRequest(tp=2, pp=1))
    with pytest.raises(PlanError, match="DeepSeek-V3.2 needs q_lora_rank in config.json"):
        make_plan(
            SourceModel(config | {"q_lora_rank": None}, model.tensors),
            ConversionRequest(tp=2, pp=1),
        )


def test_fp8_quantizes_wq_b_and_the_fused_wk_reads_the_dequantized_wk() -> None:
    model = source(num_hidden_layers=2, quantization_config=TINY_FP8, hidden_size=256)
    wk = f"model.layers.0.{IDX}wk.weight"
    assert model.tensors[f"model.layers.0.{IDX}wq_b.weight"][0] == "F8_E4M3"
    assert model.tensors[wk] == ("F8_E4M3", (128, 256))
    assert model.tensors[wk + "_scale_inv"] == ("F32", (1, 2))
    plan = make_plan(with_dequantized(model), ConversionRequest(tp=2, pp=1))
    target = rank(plan, "target", 0, 0)
    assert target[f"model.layers.0.{IDX}wq_b.weight_scale_inv"].shape == (4, 1)
    fused = target[f"model.layers.0.{IDX}wk_weights_proj.weight"]
    assert fused.dtype == "BF16" and fused.blocks[0].source == wk + ".dequantized"
    assert f"model.layers.0.{IDX}wk_weights_proj.weight_scale_inv" not in target
    skipped = dict(plan.models[0].skipped)
    assert skipped[wk + "_scale_inv"] == f"the block scales of {wk}, dequantized into it"
    # A checkpoint that stores wk in bfloat16 (fp8 elsewhere) needs no scales for it.
    tensors = {n: v for n, v in model.tensors.items() if not n.endswith("wk.weight_scale_inv")}
    tensors = {
        n: (("BF16", v[1]) if n.endswith(f"{IDX}wk.weight") else v) for n, v in tensors.items()
    }
    fused = rank(
        make_plan(SourceModel(model.config, tensors), ConversionRequest(tp=2, pp=1)), "target", 0, 0
    )
    assert fused[f"model.layers.0.{IDX}wk_weights_proj.weight"].blocks[0].source == wk


def test_a_tiny_checkpoint_converts_to_the_indexer_vllm_holds(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", V32, num_hidden_layers=3, num_nextn_predict_layers=1)
    source_tensors = load_file(model / "model.safetensors")
    convert(str(model), tmp_path / "a", Options(tp=2, pp=2), progress=False)
    manifest = read_manifest(tmp_path / "a")
    assert [(m.role, m.architecture) for m in manifest.models] == [
        ("target", V32),
        ("draft", "mtp"),
    ]
    for f in manifest.files:
        state = load_file(tmp_path / "a" / f.path)
        for name, value in state.items():
            if ".indexer." not in name:
                continue
            layer = name.split(".")[2]
            hf = f"model.layers.{layer}.{IDX}"
            if name.endswith("wk_weights_proj.weight"):
                parts = [
                    source_tensors[hf + "wk.weight"],
                    source_tensors[hf + "weights_proj.weight"],
                ]
                assert torch.equal(value, torch.cat(parts))
            else:
                suffix = name.split(".indexer.")[1]
                assert torch.equal(value, source_tensors[hf + suffix]), name
                assert value.dtype == (torch.float32 if "k_norm" in name else torch.bfloat16)


def test_the_plan_command_names_the_family_and_its_mtp_draft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", V32, num_hidden_layers=2, num_nextn_predict_layers=1)
    assert main(["plan", str(model), "--tp", "2", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(m["role"], m["architecture"]) for m in data["models"]] == [
        ("target", V32),
        ("draft", "mtp"),
    ]


def test_convert_dequantizes_an_fp8_wk_as_vllm_does(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "m",
        V32,
        num_hidden_layers=2,
        num_nextn_predict_layers=1,
        quantization_config=TINY_FP8,
        hidden_size=256,
    )
    stored = load_file(model / "model.safetensors")
    convert(str(model), tmp_path / "a", Options(tp=2, pp=1, dtype="float32"), progress=False)
    manifest = read_manifest(tmp_path / "a")
    seen = set()
    for f in manifest.files:
        for name, value in load_file(tmp_path / "a" / f.path).items():
            if not name.endswith("wk_weights_proj.weight"):
                continue
            hf = f"model.layers.{name.split('.')[2]}.{IDX}"
            weight, scale = stored[hf + "wk.weight"], stored[hf + "wk.weight_scale_inv"]
            assert weight.dtype == torch.float8_e4m3fn and scale.shape == (1, 2)
            # vLLM: scaled_dequantize to bfloat16, then the copy into a float32 parameter
            blocks = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            dequantized = (weight.float() * blocks).bfloat16().float()
            assert value.dtype == torch.float32
            assert torch.equal(value[:128], dequantized)
            assert torch.equal(value[128:], stored[hf + "weights_proj.weight"].float())
            seen.add((f.role, name))
    assert len(seen) == 3  # layers 0 and 1 of the target, the MTP layer 2 of the draft
    report = verify(tmp_path / "a", full=True)  # re-planned and compared with the source
    assert report.ok and report.round_trip_tensors > 0, report.problems
