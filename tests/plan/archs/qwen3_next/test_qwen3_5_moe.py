"""Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration` as published) and its MTP draft,
without an engine (tests/vllm/test_vllm_qwen3_5_moe.py compares with vLLM's own state).

The rank bytes of a tiny checkpoint are checked against the rules read from vLLM:
- `in_proj_qkvz`: `Qwen3_5Model.hf_to_vllm_mapper` loads `in_proj_qkv` with shard ids
  (0, 1, 2) and `in_proj_z` with 3 into a MergedColumnParallelLinear of outputs
  [K, K, V, V] (`create_qkvz_proj`, `gqa_interleaved_layout=False`): rank r holds
  q[r], k[r], v[r], z[r]; `in_proj_ba` ([V heads] * 2) holds b[r], a[r];
- experts: `RoutedExperts.load_weights` chunks a fused `gate_up_proj` [E, 2I, H] in two
  along dim 1 (w1, w3) and `_load_w13` takes the rank's rows of each; `down_proj` [E, H, I]
  goes to `_load_w2`, the rank's columns;
- the vision tower: `Qwen2_5_VisionAttention.qkv` is a QKVParallelLinear given the fused
  `attn.qkv` (the rank's rows of q, of k, of v); `Qwen3_VisionMLP.linear_fc1` column- and
  `linear_fc2` row-parallel, a RowParallelLinear's bias whole;
- lm_head: `Qwen3_5ForCausalLMBase` builds it on the last stage only;
- the MTP draft: `Qwen3_5MTP.load_weights` renames `mtp.` to `model.` and reads
  `model.language_model.embed_tokens.weight` as `model.embed_tokens.weight`.
And the published config of Qwen3.6-35B-A3B plans at tp8 x pp2, tp8 x pp4 and tp16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plans import rank_shapes as shapes_of
from safetensors.torch import load_file

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

DATA = Path(__file__).resolve().parents[3] / "data" / "qwen3.6-35b-a3b"
ARCH = "Qwen3_5MoeForConditionalGeneration"
SRC = "model.language_model.layers.0."
DST = "language_model.model.layers.0."


def published() -> SourceModel:
    config = json.loads((DATA / "config.json").read_text())
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    draft = archs.draft_family("mtp", family.name)
    shapes = family.expected_shapes(read) | draft.expected_shapes(read)
    return SourceModel(config, {n: ("BF16", s) for n, s in shapes.items()})


@pytest.fixture(scope="module")
def qwen36() -> SourceModel:
    return published()


def test_the_published_config_implies_the_published_names(qwen36: SourceModel) -> None:
    names = qwen36.tensors
    linear = SRC + "linear_attn."
    assert names[linear + "in_proj_qkv.weight"] == ("BF16", (2 * 2048 + 4096, 2048))
    assert names[linear + "in_proj_z.weight"] == ("BF16", (4096, 2048))
    assert names[linear + "in_proj_b.weight"] == ("BF16", (32, 2048))
    assert names[SRC + "mlp.experts.gate_up_proj"] == ("BF16", (256, 1024, 2048))
    assert names[SRC + "mlp.experts.down_proj"] == ("BF16", (256, 2048, 512))
    assert names["model.visual.blocks.26.attn.qkv.weight"] == ("BF16", (3456, 1152))
    assert names["model.visual.merger.linear_fc2.weight"] == ("BF16", (2048, 4608))
    assert names["mtp.layers.0.mlp.experts.gate_up_proj"] == ("BF16", (256, 1024, 2048))
    assert "model.language_model.layers.3.linear_attn.A_log" not in names  # full attention
    assert names["lm_head.weight"] == ("BF16", (248320, 2048))


@pytest.mark.parametrize(("tp", "pp"), [(8, 2), (8, 4), (16, 1)])
def test_qwen3_5_moe_plans_at_the_topologies_it_is_served_with(
    qwen36: SourceModel, tp: int, pp: int
) -> None:
    plan = make_plan(qwen36, ConversionRequest(tp=tp, pp=pp, draft_method="mtp"), qwen36)
    assert [m.method for m in plan.models] == [None, "mtp"]
    first, last = shapes_of(plan, "target", 0, 0), shapes_of(plan, "target", pp - 1, tp - 1)
    linear = DST + "linear_attn."
    assert first[linear + "in_proj_qkvz.weight"] == ("BF16", ((2 * 2048 + 2 * 4096) // tp, 2048))
    assert first[linear + "in_proj_ba.weight"] == ("BF16", (64 // tp, 2048))
    assert first[linear + "A_log"] == ("F32", (32 // tp,))
    experts = DST + "mlp.experts.routed_experts."
    assert first[experts + "w13_weight"] == ("BF16", (256, 1024 // tp, 2048))
    assert first[experts + "w2_weight"] == ("BF16", (256, 2048, 512 // tp))
    for stage in (first, last):  # the vision tower and the embedding on every stage
        assert stage["visual.blocks.0.attn.qkv.weight"] == ("BF16", (3456 // tp, 1152))
        assert stage["visual.pos_embed.weight"] == ("BF16", (2304, 1152))
        assert stage["language_model.model.embed_tokens.weight"] == ("BF16", (248320 // tp, 2048))
    assert last["language_model.lm_head.weight"] == ("BF16", (248320 // tp, 2048))
    for name in ("language_model.model.norm.weight", "language_model.lm_head.weight"):
        assert (name in first) == (pp == 1)  # the last stage's only
    layers = {int(n.split(".")[3]) for n in last if n.startswith("language_model.model.layers.")}
    assert max(layers) == 39 and len(layers) == 40 // pp
    draft = shapes_of(plan, "draft", pp - 1, 0)
    assert draft["model.fc.weight"] == ("BF16", (2048 // tp, 4096))
    assert draft["model.layers.0.mlp.experts.routed_experts.w13_weight"][1] == (
        256,
        1024 // tp,
        2048,
    )
    assert ("model.embed_tokens.weight" in draft) == (pp > 1) and "lm_head.weight" not in draft


def test_a_tp_the_vision_tower_cannot_use_is_refused(qwen36: SourceModel) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(qwen36, ConversionRequest(tp=32, pp=1))
    assert "the vision tower's num_heads (16) is not divisible by tp=32" in str(info.value)


@pytest.mark.parametrize(("experts", "rows", "cols", "tp"), [(3, 10, 7, 5), (5, 6, 9, 3)])
def test_the_expert_matrix_cuts_take_each_experts_rows_of_both_halves_and_its_columns(
    experts: int, rows: int, cols: int, tp: int
) -> None:
    shape = (experts, rows, cols)
    for rank in range(tp):
        half, c = rows // 2 // tp, rows // tp
        halves = piece_blocks(Piece("gu", Cut.EXPERT_HALVES_ROWS, expert=2), shape, tp, rank)
        assert halves == (
            Block("gu", (2, 3), slab=((rank * half, (rank + 1) * half), (0, cols), (half, cols))),
            Block(
                "gu",
                (2, 3),
                slab=(
                    (rows // 2 + rank * half, rows // 2 + (rank + 1) * half),
                    (0, cols),
                    (half, cols),
                ),
            ),
        )
        (down,) = piece_blocks(
            Piece("d", Cut.EXPERT_COLS, expert=1), (experts, cols, rows), tp, rank
        )
        assert down == Block("d", (1, 2), slab=((0, cols), (rank * c, (rank + 1) * c), (cols, c)))
    with pytest.raises(PlanError, match="not divisible by 4"):
        piece_blocks(Piece("gu", Cut.EXPERT_HALVES_ROWS, expert=0), (2, 6, 4), 2, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen35")
    model = make_tiny_model(root / "m", ARCH, num_hidden_layers=2)
    convert(str(model), root / "out", Options(tp=2, pp=2), progress=False)
    return model, root / "out"


def rank_file(out: Path, role: str, pp: int, tp: int) -> dict[str, torch.Tensor]:
    (entry,) = read_manifest(out).rank_files(role, pp, tp)
    return load_file(out / entry.path)


@pytest.mark.parametrize("tp", [0, 1])
def test_a_rank_file_holds_vllms_fused_rows_of_the_separate_projections(
    tiny: tuple[Path, Path], tp: int
) -> None:
    model, out = tiny
    source, rank = load_file(model / "model.safetensors"), rank_file(out, "target", 0, tp)
    key, value, v_heads = 2 * 128, 4 * 128, 4  # linear key/value heads x head dims

    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(2)[tp]

    qkv, z = (
        source[SRC + "linear_attn.in_proj_qkv.weight"],
        source[SRC + "linear_attn.in_proj_z.weight"],
    )
    q, k, v = qkv[:key], qkv[key : 2 * key], qkv[2 * key :]
    assert v.shape[0] == value
    expected = torch.cat([mine(q), mine(k), mine(v), mine(z)])
    assert torch.equal(rank[DST + "linear_attn.in_proj_qkvz.weight"], expected)
    b, a = (
        source[SRC + "linear_attn.in_proj_b.weight"],
        source[SRC + "linear_attn.in_proj_a.weight"],
    )
    assert b.shape[0] == v_heads
    assert torch.equal(rank[DST + "linear_attn.in_proj_ba.weight"], torch.cat([mine(b), mine(a)]))
    gate_up, down = source[SRC + "mlp.experts.gate_up_proj"], source[SRC + "mlp.experts.down_proj"]
    gate, up = gate_up.chunk(2, dim=1)
    w13 = torch.cat([gate.chunk(2, dim=1)[tp], up.chunk(2, dim=1)[tp]], dim=1)
    experts = DST + "mlp.experts.routed_experts."
    assert torch.equal(rank[experts + "w13_weight"], w13)
    assert torch.equal(rank[experts + "w2_weight"], down.chunk(2, dim=2)[tp])
    a_log = rank[DST + "linear_attn.A_log"]
    assert a_log.dtype == torch.float32
    assert torch.equal(a_log, mine(source[SRC + "linear_attn.A_log"]).float())
    vq = source["model.visual.blocks.1.attn.qkv.weight"]
    assert torch.equal(
        rank["visual.blocks.1.attn.qkv.weight"], torch.cat([mine(p) for p in vq.chunk(3)])
    )
    fc2 = source["model.visual.blocks.1.mlp.linear_fc2.weight"]
    assert torch.equal(rank["visual.blocks.1.mlp.linear_fc2.weight"], fc2.chunk(2, dim=1)[tp])
    assert torch.equal(
        rank["visual.blocks.1.mlp.linear_fc2.bias"],
        source["model.visual.blocks.1.mlp.linear_fc2.bias"],
    )


def test_the_mtp_draft_is_on_the_last_stage_with_the_text_models_embedding(
    tiny: tuple[Path, Path],
) -> None:
    model, out = tiny
    manifest = read_manifest(out)
    assert manifest.model("draft").method == "mtp"
    assert {e.pp for e in manifest.files if e.role == "draft"} == {1}
    source, draft = load_file(model / "model.safetensors"), rank_file(out, "draft", 1, 1)
    embed = source["model.language_model.embed_tokens.weight"]  # 1000 rows, padded to 1024
    mine = draft["model.embed_tokens.weight"]
    assert torch.equal(mine[: 1000 - 512], embed[512:]) and not mine[1000 - 512 :].any()
    assert torch.equal(draft["model.fc.weight"], source["mtp.fc.weight"].chunk(2)[1])
    up = source["mtp.layers.0.mlp.experts.gate_up_proj"].chunk(2, dim=1)[1]
    w13 = draft["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert torch.equal(w13[:, w13.shape[1] // 2 :], up.chunk(2, dim=1)[1])
    assert "lm_head.weight" not in draft
    # The vision tower is on both stages, the text layers split between them.
    first, last = rank_file(out, "target", 0, 0), rank_file(out, "target", 1, 0)
    assert "visual.merger.norm.weight" in first and "visual.merger.norm.weight" in last
    assert DST + "input_layernorm.weight" in first and DST + "input_layernorm.weight" not in last
    head = source["lm_head.weight"]
    assert "language_model.lm_head.weight" not in first
    assert torch.equal(last["language_model.lm_head.weight"][:512], head[:512])
