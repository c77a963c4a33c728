"""Qwen3-Next (`Qwen3NextForCausalLM`) and its MTP draft, planned without a byte: the
published config.json of Qwen3-Next-80B-A3B (48 layers, a full-attention layer every four,
512 experts, MTP) at the topologies it is served with; the cut of a DeltaNet's conv1d at
odd sizes; and what a tiny checkpoint's conversion writes."""

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
from shardprep.plan.cuts import Block, Cut, Piece
from shardprep.plan.layout import piece_blocks
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

DATA = Path(__file__).resolve().parents[3] / "data" / "qwen3-next-80b-a3b"
NEXT = "Qwen3NextForCausalLM"
LINEAR = "model.layers.0.linear_attn."


def published() -> SourceModel:
    """Qwen3-Next-80B-A3B's config and the tensors it implies (bfloat16)."""
    config = json.loads((DATA / "config.json").read_text())
    family = archs.target_family(config)[1]
    draft = archs.draft_family("mtp", family.name)
    shapes = family.expected_shapes(config) | draft.expected_shapes(config)
    return SourceModel(config, {n: ("BF16", s) for n, s in shapes.items()})


@pytest.fixture(scope="module")
def next80b() -> SourceModel:
    return published()


def test_the_published_config_implies_qwen3_nexts_tensors(next80b: SourceModel) -> None:
    names = next80b.tensors
    # 36 DeltaNet layers (7 tensors and 2 norms) and 12 full-attention layers (6 and 2),
    # each with a router, a shared expert of 3, its gate and 512 x 3 experts; embedding,
    # final norm, lm_head; the MTP draft's fc, 3 norms and one full-attention layer.
    moe = 1 + 3 + 1 + 512 * 3
    assert len(names) == 36 * (9 + moe) + 12 * (8 + moe) + 3 + 4 + (8 + moe)
    assert names[LINEAR + "in_proj_qkvz.weight"] == ("BF16", (12288, 2048))
    assert names[LINEAR + "conv1d.weight"] == ("BF16", (8192, 1, 4))
    assert names["model.layers.3.self_attn.q_proj.weight"] == ("BF16", (8192, 2048))
    assert "model.layers.3.linear_attn.A_log" not in names  # every fourth layer is full
    assert names["mtp.layers.0.mlp.experts.511.down_proj.weight"] == ("BF16", (2048, 512))


# One topology in the suite (planning a published model takes seconds); tp8 x pp4 plan
# with scripts/bench_plan.py --model qwen3-next.
@pytest.mark.parametrize(("tp", "pp"), [(8, 2)])
def test_qwen3_next_plans_at_the_topologies_it_is_served_with(
    next80b: SourceModel, tp: int, pp: int
) -> None:
    plan = make_plan(next80b, ConversionRequest(tp=tp, pp=pp, draft_method="mtp"), next80b)
    assert [m.method for m in plan.models] == [None, "mtp"]
    assert {(f.role, f.pp) for f in plan.files if f.role == "draft"} == {("draft", pp - 1)}
    first, last = shapes_of(plan, "target", 0, 0), shapes_of(plan, "target", pp - 1, tp - 1)
    assert first[LINEAR + "in_proj_qkvz.weight"] == ("BF16", (12288 // tp, 2048))
    assert first[LINEAR + "in_proj_ba.weight"] == ("BF16", (64 // tp, 2048))
    assert first[LINEAR + "conv1d.weight"] == ("BF16", (8192 // tp, 1, 4))
    assert first[LINEAR + "A_log"] == ("F32", (32 // tp,))
    assert first[LINEAR + "dt_bias"] == ("BF16", (32 // tp,))
    assert first[LINEAR + "out_proj.weight"] == ("BF16", (2048, 4096 // tp))
    kv = max(1, 2 // tp) * 256
    qkv = first["model.layers.3.self_attn.qkv_proj.weight"]
    assert qkv == ("BF16", (2 * 16 * 256 // tp + 2 * kv, 2048))
    assert first["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (
        "BF16",
        (512, 2 * 512 // tp, 2048),
    )
    assert first["model.layers.0.mlp.shared_expert_gate.weight"] == ("BF16", (1, 2048))
    for stage in (first, last):  # vLLM builds both on every stage
        assert stage["model.embed_tokens.weight"] == ("BF16", (151936 // tp, 2048))
        assert stage["lm_head.weight"] == ("BF16", (151936 // tp, 2048))
    assert "model.norm.weight" in last and ("model.norm.weight" in first) == (pp == 1)
    draft = shapes_of(plan, "draft", pp - 1, 0)
    assert draft["model.fc.weight"] == ("BF16", (2048 // tp, 4096))
    assert draft["model.layers.0.mlp.experts.routed_experts.w2_weight"] == (
        "BF16",
        (512, 2048, 512 // tp),
    )
    assert ("model.embed_tokens.weight" in draft) == (pp > 1)
    assert "lm_head.weight" not in draft
    layers = {int(n.split(".")[2]) for n in last if n.startswith("model.layers.")}
    assert max(layers) == 47 and len(layers) == 48 // pp


def test_a_tp_that_qwen3_next_cannot_use_is_refused_with_every_reason(
    next80b: SourceModel,
) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(next80b, ConversionRequest(tp=32, pp=1))
    message = str(info.value)
    assert "num_attention_heads (16) is not divisible by tp=32" in message
    assert "linear_num_key_heads (16) is not divisible by tp=32" in message


@pytest.mark.parametrize(
    ("qk", "v", "tp"), [(15, 21, 3), (6, 12, 2), (4, 4, 4), (10, 30, 5), (7, 7, 1)]
)
def test_the_qkv_rows_cut_gives_each_rank_its_q_then_k_then_v_rows(
    qk: int, v: int, tp: int
) -> None:
    rows = 2 * qk + v
    piece = Piece("conv", Cut.QKV_ROWS, heads=qk)
    covered: list[int] = []
    for rank in range(tp):
        blocks = piece_blocks(piece, (rows, 1, 4), tp, rank)
        q, k, w = (qk // tp, qk // tp, v // tp)
        assert blocks == (
            Block("conv", (rank * q, (rank + 1) * q)),
            Block("conv", (qk + rank * k, qk + (rank + 1) * k)),
            Block("conv", (2 * qk + rank * w, 2 * qk + (rank + 1) * w)),
        )
        covered += [r for b in blocks for r in range(*b.rows)]
    assert sorted(covered) == list(range(rows))  # every row once, no gap, no overlap


def test_the_qkv_rows_cut_refuses_a_tp_that_does_not_divide_each_part() -> None:
    with pytest.raises(PlanError, match="conv has 15 q rows, not divisible by 2"):
        piece_blocks(Piece("conv", Cut.QKV_ROWS, heads=15), (51, 1, 4), 2, 0)
    with pytest.raises(PlanError, match="conv has 12 v rows, not divisible by 5"):
        piece_blocks(Piece("conv", Cut.QKV_ROWS, heads=10), (32, 1, 4), 5, 0)
    with pytest.raises(PlanError, match="cannot hold q and k rows of 16 each"):
        piece_blocks(Piece("conv", Cut.QKV_ROWS, heads=16), (32, 1, 4), 2, 0)


def test_a_rank_file_holds_its_q_k_and_v_conv_rows_and_a_float32_a_log(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", NEXT, num_hidden_layers=2)
    convert(str(model), tmp_path / "out", Options(tp=2, pp=1), progress=False)
    manifest = read_manifest(tmp_path / "out")
    assert manifest.model("draft").method == "mtp"
    source = load_file(model / "model.safetensors")
    (entry,) = manifest.rank_files("target", 0, 1)
    rank = load_file(tmp_path / "out" / entry.path)
    conv, whole = rank[LINEAR + "conv1d.weight"], source[LINEAR + "conv1d.weight"]
    key = 2 * 128  # linear_num_key_heads x linear_key_head_dim
    assert torch.equal(conv[:128], whole[128:key])
    assert torch.equal(conv[128:256], whole[key + 128 : 2 * key])
    assert torch.equal(conv[256:], whole[2 * key + 256 :])
    a_log = rank[LINEAR + "A_log"]
    assert a_log.dtype == torch.float32 and torch.equal(a_log, source[LINEAR + "A_log"][2:].float())
    qkvz = source[LINEAR + "in_proj_qkvz.weight"]
    assert torch.equal(rank[LINEAR + "in_proj_qkvz.weight"], qkvz[qkvz.shape[0] // 2 :])


def test_the_plan_command_names_the_mtp_draft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", NEXT)
    assert main(["plan", str(model), "--tp", "2", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(m["role"], m["architecture"]) for m in data["models"]] == [
        ("target", NEXT),
        ("draft", "mtp"),
    ]


def test_a_checkpoint_without_mtp_tensors_converts_the_target_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", NEXT, num_hidden_layers=2)
    tensors = load_file(model / "model.safetensors")
    save_file(
        {n: t for n, t in tensors.items() if not n.startswith("mtp.")}, model / "model.safetensors"
    )
    out = tmp_path / "out"
    assert main(["convert", str(model), "-o", str(out), "--tp", "2", "--quiet"]) == 0
    assert "the target is converted without a mtp draft" in capsys.readouterr().out
    assert read_manifest(out).model("draft") is None
