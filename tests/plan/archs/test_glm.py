"""GLM-4.5 (`Glm4MoeForCausalLM`) and its MTP draft, planned without a byte: the published
config.json of GLM-4.5 (355B, 92 layers, 160 experts, one MTP layer) at the topologies it
is served with, and what a tiny checkpoint's conversion writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plans import rank_shapes as shapes_of
from safetensors.torch import load_file, save_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.errors import PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

DATA = Path(__file__).resolve().parents[2] / "data" / "glm-4.5"
GLM = "Glm4MoeForCausalLM"


def published() -> SourceModel:
    """GLM-4.5's config and the tensors it implies (bfloat16, the routing bias float32)."""
    config = json.loads((DATA / "config.json").read_text())
    family = archs.target_family(config)[1]
    draft = archs.draft_family("mtp", family.name)
    shapes = family.expected_shapes(config) | draft.expected_shapes(config)
    dtypes = family.source_dtypes(config)
    return SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})


@pytest.fixture(scope="module")
def glm45() -> SourceModel:
    return published()


def test_the_published_config_implies_glm45s_tensors(glm45: SourceModel) -> None:
    names = glm45.tensors
    # Per layer 11 attention and norm tensors; 3 dense MLP tensors in layers 0-2, else the
    # router, its bias, 3 shared-expert and 160 x 3 expert tensors; the MTP layer 92 has 4
    # more; embedding, final norm, lm_head.
    assert len(names) == 3 * (11 + 3) + 90 * (11 + 5 + 480) + 4 + 3
    assert names["model.layers.3.mlp.experts.159.down_proj.weight"] == ("BF16", (5120, 1536))
    assert names["model.layers.92.eh_proj.weight"] == ("BF16", (5120, 10240))
    assert names["model.layers.5.mlp.gate.e_score_correction_bias"] == ("F32", (160,))
    assert "model.layers.2.mlp.gate.weight" not in names  # three dense layers first


# One topology in the suite (planning a published model takes seconds); tp8 x pp2 and tp8 x pp4 plan
# with scripts/bench_plan.py --model glm-4.5.
@pytest.mark.parametrize(("tp", "pp"), [(16, 1)])
def test_glm45_plans_at_the_topologies_it_is_served_with(
    glm45: SourceModel, tp: int, pp: int
) -> None:
    plan = make_plan(glm45, ConversionRequest(tp=tp, pp=pp, draft_method="mtp"), glm45)
    assert [m.method for m in plan.models] == [None, "mtp"]
    assert {(f.role, f.pp) for f in plan.files if f.role == "draft"} == {("draft", pp - 1)}
    last = shapes_of(plan, "target", pp - 1, tp - 1)
    first = shapes_of(plan, "target", 0, 0)
    kv = max(1, 8 // tp) * 128
    assert first["model.layers.0.self_attn.qkv_proj.weight"] == (
        "BF16",
        (96 * 128 // tp + 2 * kv, 5120),
    )
    assert first["model.layers.0.self_attn.qkv_proj.bias"] == ("BF16", (96 * 128 // tp + 2 * kv,))
    assert first["model.layers.3.mlp.gate.weight"] == ("F32", (160, 5120))
    assert first["model.layers.3.mlp.experts.routed_experts.w13_weight"] == (
        "BF16",
        (160, 2 * 1536 // tp, 5120),
    )
    assert first["model.layers.3.mlp.shared_experts.down_proj.weight"] == (
        "BF16",
        (5120, 1536 // tp),
    )
    assert first["model.embed_tokens.weight"] == ("BF16", (151552 // tp, 5120))
    assert "lm_head.weight" in last
    assert ("model.embed_tokens.weight" in last) == (pp == 1)
    draft = shapes_of(plan, "draft", pp - 1, 0)
    assert draft["model.layers.92.mtp_block.mlp.experts.routed_experts.w2_weight"] == (
        "BF16",
        (160, 5120, 1536 // tp),
    )
    assert draft["model.layers.92.eh_proj.weight"] == ("BF16", (5120, 10240))
    assert ("model.embed_tokens.weight" in draft) == (pp > 1)
    assert "model.layers.92.shared_head.head.weight" not in draft
    layers = {int(n.split(".")[2]) for n in last if n.startswith("model.layers.")}
    assert max(layers) == 91 and len(layers) == 92 // pp


def test_a_tp_that_glm45_cannot_use_is_refused_with_every_reason(glm45: SourceModel) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(glm45, ConversionRequest(tp=7, pp=2))
    message = str(info.value)
    assert "num_attention_heads (96) is not divisible by tp=7" in message
    assert "the experts' intermediate size (1536) is not divisible by tp x dp = 7" in message


def test_the_plan_command_names_the_mtp_draft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", GLM, num_hidden_layers=4, num_nextn_predict_layers=1)
    assert main(["plan", str(model), "--tp", "2", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(m["role"], m["architecture"]) for m in data["models"]] == [
        ("target", GLM),
        ("draft", "mtp"),
    ]


def test_the_mtp_layer_is_the_draft_and_the_router_is_float32(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", GLM, num_hidden_layers=3, num_nextn_predict_layers=1)
    out = convert(str(model), tmp_path / "out", Options(tp=2, pp=2), progress=False)
    manifest = read_manifest(tmp_path / "out")
    assert out is not None and manifest.model("draft").method == "mtp"
    source = load_file(model / "model.safetensors")
    (entry,) = manifest.rank_files("draft", 1, 0)
    draft = load_file(tmp_path / "out" / entry.path)
    router = draft["model.layers.3.mtp_block.mlp.gate.weight"]
    assert router.dtype == torch.float32
    assert torch.equal(router, source["model.layers.3.mlp.gate.weight"].float())
    qkv = draft["model.layers.3.mtp_block.self_attn.qkv_proj.weight"]
    q, k = (
        source["model.layers.3.self_attn.q_proj.weight"],
        source["model.layers.3.self_attn.k_proj.weight"],
    )
    assert torch.equal(qkv[:64], q[:64]) and torch.equal(qkv[64:96], k[:32])


def test_a_promised_mtp_layer_the_checkpoint_lacks_converts_the_target_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", GLM, num_hidden_layers=3, num_nextn_predict_layers=1)
    tensors = load_file(model / "model.safetensors")
    kept = {n: t for n, t in tensors.items() if not n.startswith("model.layers.3.")}
    save_file(kept, model / "model.safetensors")
    out = tmp_path / "out"
    assert main(["convert", str(model), "-o", str(out), "--tp", "2", "--quiet"]) == 0
    assert "the target is converted without a mtp draft" in capsys.readouterr().out
    assert read_manifest(out).model("draft") is None
