"""Kimi-K2.5 / K2.6 (`KimiK25ForConditionalGeneration`), planned without vLLM: the
published config.json and tensor table of moonshotai/Kimi-K2.5 (tests/data/kimi-k2.5:
DeepSeek-V3's text model under `language_model.` with int4 routed experts, a MoonViT
vision tower and its projector in bfloat16) at the topologies it is served with, the
quantization's ignore list matched under the `language_model.` prefix, the vision
tower's cuts on real bytes, and the vision config read as vLLM reads it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from artifacts import rank_tensors
from plans import rank_tensors as rank
from safetensors.torch import load_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_INT4, TINY_MOONVIT, make_tiny_model, tiny_config
from shardprep.errors import ConfigError, PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.deepseek.kimi_k25 import NO_MTP, VisionDims
from shardprep.plan.archs.parts import quantized
from shardprep.plan.cuts import Cut
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
from shardprep.plan.topology import Topology

DATA = Path(__file__).resolve().parents[3] / "data" / "kimi-k2.5"
KIMI = "KimiK25ForConditionalGeneration"
RANGES = {"{L}": 61, "{D}": 1, "{M}": 60, "{E}": 384, "{B}": 27}
FIRST = {"{M}": 1}
LM = "language_model.model.layers."
BLOCK = "vision_tower.encoder.blocks.0."


def published_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    """The published checkpoint's 208,550 tensors, from the table of its groups."""
    table = json.loads((DATA / "tensors.json").read_text())
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for pattern, (dtype, shape) in table["groups"].items():
        keys = [k for k in RANGES if k in pattern]
        spans = [range(FIRST.get(k, 0), FIRST.get(k, 0) + RANGES[k]) for k in keys]
        for values in itertools.product(*spans):
            name = pattern
            for key, value in zip(keys, values, strict=True):
                name = name.replace(key, str(value))
            found[name] = (dtype, tuple(shape))
    assert len(found) == table["count"]
    return found


@pytest.fixture(scope="module")
def published() -> SourceModel:
    return SourceModel(json.loads((DATA / "config.json").read_text()), published_tensors())


def test_the_family_implies_the_published_tensors(published: SourceModel) -> None:
    config = archs.read_config(published.config)
    family = archs.target_family(config)[1]
    assert (family.name, config["num_hidden_layers"], config["n_routed_experts"]) == (
        "kimi_k25",
        61,
        384,
    )
    shapes = quantized.expected_shapes(family, config)
    dtypes = quantized.source_dtypes(family, config)
    assert {n: (dtypes.get(n, "BF16"), tuple(s)) for n, s in shapes.items()} == published.tensors
    # The ignore list, matched under language_model.: only the routed experts are int4.
    weights = quantized.quantized(family, config, shapes)
    assert len(weights) == 60 * 384 * 3
    assert set(weights.values()) == {f"{LM}{m}.mlp.experts" for m in range(1, 61)}
    assert archs.internal_draft_method(config) is None  # vLLM serves no MTP draft for it


# One topology in the suite (planning a published model takes seconds); tp8 x pp2 and tp16 plan
# with scripts/bench_plan.py --model kimi-k2.6.
@pytest.mark.parametrize(("tp", "pp"), [(8, 4)])
def test_kimi_k25_plans_at_the_topologies_it_is_served_with(
    published: SourceModel, tp: int, pp: int
) -> None:
    plan = make_plan(published, ConversionRequest(tp=tp, pp=pp))
    assert [(m.family, m.quantization) for m in plan.models] == [("kimi_k25", "compressed-tensors")]
    head = 1152 // tp
    for stage in range(pp):  # the tower and the projector on every stage, as vLLM builds them
        ours = rank(plan, stage, tp - 1)
        wqkv = ours[BLOCK + "wqkv.weight"]
        assert (wqkv.dtype, wqkv.shape) == ("BF16", (3 * head, 1152))
        assert [b.rows for b in wqkv.blocks] == [
            (part * 1152 + (tp - 1) * head, part * 1152 + tp * head) for part in range(3)
        ]
        assert ours[BLOCK + "wo.weight"].shape == (1152, head)
        assert ours[BLOCK + "wo.bias"].shape == (1152,)
        assert ours[BLOCK + "mlp.fc0.weight"].shape == (4304 // tp, 1152)
        assert ours[BLOCK + "mlp.fc1.weight"].shape == (1152, 4304 // tp)
        assert ours["vision_tower.patch_embed.proj.weight"].shape == (1152, 3, 14, 14)
        assert ours["vision_tower.patch_embed.pos_emb.weight"].shape == (64, 64, 1152)
        assert ours["mm_projector.linear_1.weight"].shape == (4608, 4608)
        assert ours["mm_projector.linear_2.weight"].shape == (7168, 4608)
        assert ours["mm_projector.pre_norm.bias"].shape == (1152,)
    first, last = rank(plan, 0, 0), rank(plan, pp - 1, 0)
    assert first["language_model.model.embed_tokens.weight"].shape == (163840 // tp, 7168)
    assert last["language_model.lm_head.weight"].shape == (163840 // tp, 7168)
    # DeepSeek-V3's rules under the prefix: MLA split by heads, int4 experts packed.
    assert first[LM + "0.self_attn.q_b_proj.weight"].shape == (12288 // tp, 1536)
    assert first[LM + "0.self_attn.fused_qkv_a_proj.weight"].shape == (1536 + 576, 7168)
    w13 = first[LM + "1.mlp.experts.routed_experts.w13_weight_packed"]
    assert (w13.dtype, w13.shape) == ("I32", (384, 2 * 2048 // tp, 7168 // 8))
    assert first[LM + "1.mlp.shared_experts.gate_up_proj.weight"].dtype == "BF16"
    gate = first[LM + "1.mlp.gate.e_score_correction_bias"]
    assert gate.dtype == "F32"


def test_a_tp_that_does_not_divide_the_vision_heads_replicates_the_tower() -> None:
    """vLLM's `is_vit_use_data_parallel`: 16 heads at tp 32 run the tower whole per rank."""
    config = json.loads((DATA / "config.json").read_text())
    vision = VisionDims.of(archs.read_config(config))
    assert (vision.hidden, vision.layers, vision.heads) == (1152, 27, 16)
    assert {p.pieces[0].cut for p in vision.params(32, (0,))} == {Cut.REPLICATE}
    assert Cut.PARTS_ROWS in {p.pieces[0].cut for p in vision.params(16, (0,))}


def test_a_vt_size_that_vllm_would_not_read_is_refused_in_words(published: SourceModel) -> None:
    config = json.loads(json.dumps(published.config))
    config["vision_config"]["vt_hidden_size"] = 2048
    with pytest.raises(PlanError) as info:
        make_plan(SourceModel(config, published.tensors), ConversionRequest(tp=8, pp=2))
    assert (
        "vision_config has vt_hidden_size: 2048 but vLLM reads hidden_size (1152, the "
        "default); set hidden_size: 2048 in vision_config" in str(info.value)
    )


def test_mtp_layers_are_skipped_as_vllm_drops_them() -> None:
    config = archs.read_config(tiny_config(KIMI, num_hidden_layers=2, num_nextn_predict_layers=1))
    family = archs.target_family(config)[1]
    shapes = dict(family.expected_shapes(config))
    mtp = f"{LM}2.enorm.weight"
    layout = family.layout(config, shapes | {mtp: (128,)}, Topology(1, 2, (1, 1)))
    assert layout.skipped == {mtp: NO_MTP}


def test_a_config_without_text_config_is_refused_in_words() -> None:
    with pytest.raises(ConfigError, match="has no text_config object"):
        archs.read_config({"architectures": [KIMI], "model_type": "kimi_k25"})


def test_a_tiny_checkpoint_converts_to_the_vision_cuts_on_real_bytes(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", KIMI, num_hidden_layers=3)
    source = load_file(model / "model.safetensors")
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    hidden = TINY_MOONVIT["hidden_size"]
    for stage, t in itertools.product(range(2), range(2)):
        ours = rank_tensors(artifact, "target", stage, t)
        rows = slice(t * hidden // 2, (t + 1) * hidden // 2)
        wqkv = source[BLOCK + "wqkv.weight"].view(3, hidden, hidden)[:, rows]
        assert torch.equal(ours[BLOCK + "wqkv.weight"], wqkv.reshape(-1, hidden))
        assert torch.equal(ours[BLOCK + "wo.weight"], source[BLOCK + "wo.weight"][:, rows])
        assert torch.equal(ours[BLOCK + "wo.bias"], source[BLOCK + "wo.bias"])
        linear_2 = source["mm_projector.proj.2.weight"]
        assert torch.equal(ours["mm_projector.linear_2.weight"], linear_2)
        assert ("language_model.model.embed_tokens.weight" in ours) == (stage == 0)


def test_the_kimi_k26_layout_with_int4_experts_converts(tmp_path: Path) -> None:
    """Kimi-K2.6 as published: int4 routed experts (groups of 32), the rest and the
    vision tower bfloat16; the ignore list names text layers without the prefix."""
    model = make_tiny_model(
        tmp_path / "model", KIMI, num_hidden_layers=3, moe_intermediate_size=128,
        hidden_size=256, quantization_config=TINY_INT4,
    )  # fmt: skip
    stored = load_file(model / "model.safetensors")
    assert f"{LM}1.mlp.experts.0.gate_proj.weight_packed" in stored
    assert f"{LM}1.mlp.shared_experts.gate_proj.weight" in stored
    assert BLOCK + "wqkv.weight" in stored
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    ours = rank_tensors(artifact, "target", 0, 1)
    packed = ours[f"{LM}1.mlp.experts.routed_experts.w13_weight_packed"]
    assert (packed.dtype, tuple(packed.shape)) == (torch.int32, (8, 2 * 64, 256 // 8))
    assert ours[BLOCK + "wqkv.weight"].dtype == torch.bfloat16
    assert not [n for n in ours if n.startswith("vision_tower.") and "packed" in n]


def test_the_plan_command_names_the_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "model", KIMI, num_hidden_layers=3)
    assert main(["plan", "--tp", "2", "--pp", "2", "--json", str(model)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(m["role"], m["architecture"]) for m in data["models"]] == [("target", KIMI)]


def test_tiny_config_nests_the_text_model() -> None:
    config = tiny_config(KIMI, num_hidden_layers=3, quantization_config=TINY_INT4)
    assert config["text_config"]["num_hidden_layers"] == 3
    assert config["quantization_config"] == TINY_INT4
    assert "num_hidden_layers" not in config
