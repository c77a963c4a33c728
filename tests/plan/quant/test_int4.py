"""compressed-tensors int4 (W4A16, `pack-quantized`): the packed cut on odd sizes, the
scheme's reading of config.json and its ignore list, and vLLM's refusals, planned from
headers alone; one small conversion checked against the source bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from plans import rank_tensors as rank
from plans import tiny_source
from schema import SCHEMA

from shardprep.cli import main
from shardprep.demo.tiny import TINY_INT4, make_tiny_model, tiny_config
from shardprep.errors import PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.cuts import Block, Cut, Piece, ScaleOf
from shardprep.plan.layout import block_shape, piece_blocks
from shardprep.plan.make import make_plan
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.int4 import PackQuant, pack_quant
from shardprep.plan.records import SourceModel

V3 = "DeepseekV3ForCausalLM"
EXPERTS = "model.layers.1.mlp.experts."
ROUTED = EXPERTS + "routed_experts."


def pack(values: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] (0..15) packed eight to an int32 along K, the lowest first."""
    rows, cols = values.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int64)
    padded[:, :cols] = values
    nibbles = padded.reshape(rows, -1, 8) << (4 * torch.arange(8))
    return nibbles.sum(-1).to(torch.uint32).view(torch.int32)


@pytest.mark.parametrize(
    ("shape", "cut", "tp"),
    [
        ((96, 320), Cut.COLS, 5),  # 64 columns a rank: 8 int32 each
        ((96, 320), Cut.COLS, 10),  # 32 columns a rank: 4 int32 each
        ((120, 40), Cut.ROWS, 3),  # 40 columns end in a partial int32, every rank whole
        ((48, 44), Cut.REPLICATE, 2),
        ((33, 64), Cut.ROWS, 1),
    ],
)
def test_packing_then_cutting_is_cutting_then_packing(
    shape: tuple[int, int], cut: Cut, tp: int
) -> None:
    values = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(tp))
    stored = pack(values)
    piece = Piece("w.weight_packed", Cut.PACKED, scale_of=ScaleOf(shape, cut, (1, 8)))
    plain = Piece("w.weight", cut)
    for r in range(tp):
        (block,) = piece_blocks(piece, tuple(stored.shape), tp, r)
        (part,) = piece_blocks(plain, shape, tp, r)
        cols = block.cols or (0, stored.shape[1])
        got = stored[block.rows[0] : block.rows[1], cols[0] : cols[1]]
        want_cols = part.cols or (0, shape[1])
        want = values[part.rows[0] : part.rows[1], want_cols[0] : want_cols[1]]
        assert torch.equal(got, pack(want)), r
        assert block_shape(block, tuple(stored.shape)) == tuple(got.shape)


def test_group_scales_follow_the_weight_in_whole_groups() -> None:
    piece = Piece("w.weight_scale", Cut.PACKED, scale_of=ScaleOf((64, 192), Cut.COLS, (1, 32)))
    got = [piece_blocks(piece, (64, 6), 3, rank) for rank in range(3)]
    assert got == [(Block("w.weight_scale", (0, 64), (2 * r, 2 * r + 2)),) for r in range(3)]
    rows = Piece("w.weight_scale", Cut.PACKED, scale_of=ScaleOf((96, 64), Cut.ROWS, (1, 32)))
    assert piece_blocks(rows, (96, 2), 3, 2) == (Block("w.weight_scale", (64, 96)),)
    # 192 columns at tp4: 48 a rank, so rank 1 starts inside a group of 32
    with pytest.raises(PlanError, match="columns start at 48, inside a packed element of 32"):
        piece_blocks(piece, (64, 6), 4, 1)


def test_the_scheme_reads_kimi_k2_thinking_and_refuses_the_rest() -> None:
    scheme = scheme_of({"quantization_config": TINY_INT4})
    assert scheme == pack_quant(TINY_INT4)
    assert isinstance(scheme, PackQuant) and not scheme.problem and scheme.group == 32
    weights = TINY_INT4["config_groups"]["group_0"]["weights"]

    def refused(**changes: Any) -> str:
        group = {**TINY_INT4["config_groups"]["group_0"]}
        group["weights"] = {**weights, **changes.pop("weights", {})}
        quant = {**TINY_INT4, "config_groups": {"group_0": group}, **changes}
        return pack_quant(quant).problem

    assert refused(weights={"symmetric": False}).startswith(
        "quantization_config is compressed-tensors with weights symmetric False; shardprep "
        "supports compressed-tensors pack-quantized int4 (W4A16"
    )
    assert "weights num_bits 8" in refused(weights={"num_bits": 8})
    assert "weights strategy 'channel'" in refused(weights={"strategy": "channel"})
    assert "format 'float-quantized'" in refused(format="float-quantized")
    assert "a kv_cache_scheme" in refused(kv_cache_scheme={"num_bits": 8, "type": "float"})


def test_the_ignore_list_is_matched_as_vllm_matches_it() -> None:
    scheme = pack_quant(TINY_INT4)
    layer = "model.layers.3.mlp.experts"
    assert not scheme.skips(layer, layer + ".5.gate_proj")
    assert scheme.skips("model.layers.3.self_attn.fused_qkv_a_proj")
    assert scheme.skips("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.gate_proj")
    assert scheme.skips("model.layers.3.mlp.shared_experts.down_proj")
    # vLLM asks about a FusedMoE layer through expert 0, whichever expert is named
    only_zero = PackQuant(32, ignored=("model.layers.3.mlp.experts.0.down_proj",))
    assert only_zero.skips(layer, layer + ".7.down_proj")
    assert not only_zero.skips(layer, layer + ".7.gate_proj")


def test_a_packed_weight_holds_eight_values_an_int32_along_k() -> None:
    scheme = pack_quant(TINY_INT4)
    weight = EXPERTS + "3.down_proj.weight"
    shapes = {name: shape for name, (shape, _) in scheme.stored(weight, (128, 256)).items()}
    assert shapes[weight + "_packed"] == (128, 32)
    assert scheme.weight_shape(weight, shapes) == (128, 256)
    assert scheme.weight_shape(weight, {**shapes, weight + "_scale": (128, 4)}) is None


def source(**overrides: Any) -> SourceModel:
    return tiny_source(V3, quantization_config=TINY_INT4, **overrides)


def test_routed_experts_become_packed_stacks_with_their_full_shapes() -> None:
    model = source(num_hidden_layers=2)
    assert model.tensors[EXPERTS + "3.down_proj.weight_packed"] == ("I32", (128, 32))
    assert model.tensors[EXPERTS + "3.down_proj.weight_scale"] == ("BF16", (128, 8))
    assert model.tensors[EXPERTS + "3.down_proj.weight_shape"] == ("I32", (2,))
    assert EXPERTS + "3.down_proj.weight" not in model.tensors
    plan = make_plan(
        model, ConversionRequest(tp=4, pp=1)
    )  # 64 of the 256 rows a rank: two groups of 32
    ours = rank(plan, 0, 2)
    assert (ours[ROUTED + "w13_weight_packed"].dtype, ours[ROUTED + "w13_weight_packed"].shape) == (
        "I32",
        (8, 128, 16),
    )
    assert ours[ROUTED + "w13_weight_scale"].shape == (8, 128, 4)
    assert ours[ROUTED + "w2_weight_packed"].shape == (8, 128, 8)
    assert ours[ROUTED + "w2_weight_scale"].shape == (8, 128, 2)
    # vLLM keeps each expert's whole [N, K] in the model's dtype on every rank
    shape = ours[ROUTED + "w13_weight_shape"]
    assert (shape.dtype, shape.shape) == ("BF16", (8, 2))
    assert [b.source for b in shape.blocks][:2] == [  # the one vLLM writes last: up's
        EXPERTS + "0.up_proj.weight_shape",
        EXPERTS + "1.up_proj.weight_shape",
    ]
    w2 = ours[ROUTED + "w2_weight_packed"].blocks[0]
    assert (w2.source, w2.cols) == (EXPERTS + "0.down_proj.weight_packed", (16, 24))
    # everything the ignore list names stays as the checkpoint has it
    assert ours["model.layers.1.self_attn.o_proj.weight"].dtype == "BF16"
    skipped = dict(plan.models[0].skipped)
    assert "vLLM keeps one [N, K]" in skipped[EXPERTS + "5.gate_proj.weight_shape"]


def test_vllms_group_refusal_names_the_tps_that_work() -> None:
    model = source(num_hidden_layers=2, moe_intermediate_size=128, num_attention_heads=8)
    with pytest.raises(PlanError) as caught:
        make_plan(model, ConversionRequest(tp=8, pp=1))
    assert str(caught.value) == (
        "cannot convert: target: vLLM refuses int4 groups of 32 at tp=8: "
        "model.layers.*.mlp.experts: CompressedTensors WNA16 MoE with static group scales "
        "requires the MoE intermediate size per tensor-parallel partition (16) to be divisible "
        "by group_size (32). Choose a tp that works: 1, 2, 4"
    )
    # whole experts per rank under expert parallelism: any tp the rest allows
    assert make_plan(model, ConversionRequest(tp=8, pp=1, expert_parallel=True))


def test_quantized_linear_layers_are_refused_in_one_line() -> None:
    quant = {**TINY_INT4, "ignore": ["lm_head", "re:.*shared_experts.*", "re:.*mlp\\.gate_up.*"]}
    config = tiny_config(V3, num_hidden_layers=2, quantization_config=quant)
    _, family = archs.target_family(config)
    shapes = quantized.expected_shapes(family, config)
    dtypes = quantized.source_dtypes(family, config)
    assert "model.layers.0.self_attn.o_proj.weight_packed" in shapes
    model = SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})
    with pytest.raises(PlanError) as caught:
        make_plan(model, ConversionRequest(tp=2, pp=1))
    assert str(caught.value) == (
        "cannot convert: target: compressed-tensors int4 groups of 32 of linear layers is not "
        "supported yet: the ignore list of quantization_config leaves "
        "model.layers.*.self_attn.fused_qkv_a_proj (and 4 more) quantized; shardprep converts "
        "such checkpoints when only their routed experts are quantized"
    )


def test_cli_plan_shows_the_quantization_and_the_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(
        tmp_path / "model",
        V3,
        num_hidden_layers=2,
        moe_intermediate_size=64,
        quantization_config=TINY_INT4,
    )
    assert main(["plan", "--tp", "4", str(model)]) == 1
    err = capsys.readouterr().err.strip()
    assert "vLLM refuses int4 groups of 32 at tp=4" in err
    assert "Choose a tp that works: 1, 2" in err
    assert main(["plan", "--tp", "2", str(model)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  quantization: compressed-tensors (int4_pack)" in out
    left_out = [line for line in out if "gate_proj.weight_shape" in line]
    assert len(left_out) == 1 and left_out[0].startswith("  left out: 8 tensors, e.g. ")


def test_converted_experts_are_the_source_bytes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from shardprep.convert.run import Options, convert
    from shardprep.convert.verify import verify

    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, quantization_config=TINY_INT4
    )
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    source = load_file(model / "model.safetensors")
    ours = load_file(out / "shards" / "model-pp-0-tp-1-part-0.safetensors")

    def expert(e: int, part: str) -> torch.Tensor:
        return source[f"{EXPERTS}{e}.{part}"]

    for kind in ("packed", "scale"):  # rank 1: the second half of each part's rows or K
        w13 = [
            torch.cat([expert(e, f"{p}_proj.weight_{kind}")[128:] for p in ("gate", "up")])
            for e in range(8)
        ]
        assert torch.equal(ours[ROUTED + f"w13_weight_{kind}"], torch.stack(w13))
        w2 = [expert(e, f"down_proj.weight_{kind}").chunk(2, dim=1)[1] for e in range(8)]
        assert torch.equal(ours[ROUTED + f"w2_weight_{kind}"], torch.stack(w2))
    assert ours[ROUTED + "w2_weight_shape"].dtype == torch.bfloat16
    assert ours[ROUTED + "w2_weight_shape"].tolist() == [[128.0, 256.0]] * 8
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0
    manifest = json.loads((out / "shardprep.json").read_text())
    jsonschema.validate(manifest, SCHEMA)
    assert manifest["vllm_layout"]["revisions"]["int4_pack"] == 1


def test_a_family_without_the_scheme_refuses_it_in_one_line() -> None:
    config = tiny_config("Qwen3MoeForCausalLM", num_hidden_layers=2, quantization_config=TINY_INT4)
    tensors = {f"t{i}": ("BF16", (4,)) for i in range(4)}  # refused before any is looked at
    model = SourceModel(config, tensors)
    with pytest.raises(PlanError) as caught:
        make_plan(model, ConversionRequest(tp=2, pp=1))
    assert str(caught.value) == (
        "cannot convert: target: compressed-tensors checkpoints (int4_pack) of the qwen3_moe "
        "family are not supported yet: shardprep's layout of them is not proven against vLLM; "
        "convert an unquantized checkpoint"
    )
