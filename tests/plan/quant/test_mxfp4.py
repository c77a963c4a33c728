"""MXFP4 gpt-oss (`quant_method: mxfp4`) on odd sizes, compared with vLLM's loading done
by hand (`_load_weights_mxfp4`'s cuts copied into the corner of `create_weights`' zero
parameters, sized as `mxfp4_round_up_hidden_size_and_intermediate_size` rounds them for
each MoE backend's alignments): the unpadded stacks of one artifact, padded at load by
`sharded-fast`'s fill for every backend, and the stacks a baked `--mxfp4-pad` holds; the
option's reading, the manifest's record and vLLM's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file
from schema import SCHEMA

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import TINY_MXFP4, make_tiny_model
from shardprep.errors import ConfigError, PlanError, WeightMismatchError
from shardprep.format.manifest import read_manifest
from shardprep.hub.modelcard import model_card
from shardprep.loader.fill import fill_parameters, stack_pads
from shardprep.plan.layout import mx_range
from shardprep.plan.quant.mxfp4 import Mxfp4Pad

GPT_OSS = "GptOssForCausalLM"
HUB = "model.layers.0.mlp.experts."
ROUTED = HUB + "routed_experts."
E, H, INTER = 4, 96, 160  # 3 and 5 blocks of 32: no tp splits them evenly into blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def vllm_state(source: dict, tp: int, rank: int, pad: Mxfp4Pad) -> dict[str, torch.Tensor]:
    """What vLLM's default loader leaves in one rank's MXFP4 expert parameters."""
    per_rank = cdiv(INTER // 32, tp) * 32
    start, end = rank * per_rank, min((rank + 1) * per_rank, INTER)
    start = min(start, end)
    local = cdiv(INTER // tp, pad.intermediate) * pad.intermediate
    hidden = cdiv(H, pad.hidden) * pad.hidden
    n = end - start
    blocks13 = source[HUB + "gate_up_proj_blocks"].view(E, 2 * INTER, -1)
    blocks2 = source[HUB + "down_proj_blocks"].view(E, -1, INTER // 2)
    state = {
        "w13_weight": torch.zeros(E, 2 * local, hidden // 2, dtype=torch.uint8),
        "w13_weight_scale": torch.zeros(E, 2 * local, hidden // 32, dtype=torch.uint8),
        "w2_weight": torch.zeros(E, hidden, local // 2, dtype=torch.uint8),
        "w2_weight_scale": torch.zeros(E, hidden, local // 32, dtype=torch.uint8),
        "w13_bias": torch.zeros(E, 2 * local, dtype=torch.bfloat16),
        "w2_bias": torch.zeros(E, hidden, dtype=torch.bfloat16),
    }
    state["w13_weight"][:, : 2 * n, : H // 2] = blocks13[:, 2 * start : 2 * end]
    scales13 = source[HUB + "gate_up_proj_scales"][:, 2 * start : 2 * end]
    state["w13_weight_scale"][:, : 2 * n, : H // 32] = scales13
    state["w2_weight"][:, :H, : n // 2] = blocks2[..., start // 2 : end // 2]
    scales2 = source[HUB + "down_proj_scales"][..., start // 32 : end // 32]
    state["w2_weight_scale"][:, :H, : n // 32] = scales2
    state["w13_bias"][:, : 2 * n] = source[HUB + "gate_up_proj_bias"][:, 2 * start : 2 * end]
    if rank == 0:
        state["w2_bias"][:, :H] = source[HUB + "down_proj_bias"]
    return state


class Built(torch.nn.Module):
    """One layer's expert parameters as a backend's `create_weights` builds them, filled
    with 0xFF bytes that the loader must overwrite (the padding with zeros)."""

    def __init__(self, shapes: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, like in shapes.items():
            self.register_parameter(
                name, torch.nn.Parameter(torch.full_like(like, 255).view(like.dtype), False)
            )


def padded_at_load(
    stored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What `sharded-fast` leaves in parameters shaped like `expected` from the rank
    file's stacks: the loader's own fill."""
    built = Built(
        {name: t.view(torch.uint8) if t.dtype == torch.uint8 else t for name, t in expected.items()}
    )
    tensors = [(name, stored[ROUTED + name]) for name in expected]
    fill_parameters(
        built, tensors, ignorable=set(), may_lack=set(), where="OUT",
        stacks=stack_pads("gpt_oss_mxfp4"),
    )  # fmt: skip
    return dict(built.named_parameters())


# Every alignment of vLLM's MXFP4 table (intermediate[,hidden]): the CPU and emulation,
# Triton, CUTLASS and DeepGEMM, Marlin and TRT-LLM, ROCm AITER.
BACKEND_PADS = ("32", "64", "128,128", "128,256", "256,256")


@pytest.mark.parametrize("tp", [2, 4])
def test_one_unpadded_artifact_fills_every_backends_stacks_as_vllm_loads_them(
    tmp_path: Path, tp: int
) -> None:
    model = tiny(tmp_path / "model")
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=tp, pp=1), progress=False)
    source = load_file(model / "model.safetensors")
    for rank in range(tp):
        ours = load_file(out / "shards" / f"model-pp-0-tp-{rank}-part-0.safetensors")
        start, end = mx_range(INTER, tp, rank)
        # the rank's blocks alone: none on the last rank at tp4
        assert tuple(ours[ROUTED + "w13_weight"].shape) == (E, 2 * (end - start), H // 2)
        assert tuple(ours[ROUTED + "w2_bias"].shape) == (E, H)
        for pad in BACKEND_PADS:
            expected = vllm_state(source, tp, rank, Mxfp4Pad.parse(pad))
            got = padded_at_load(ours, expected)
            for name, tensor in expected.items():
                assert got[name].dtype == tensor.dtype, (rank, pad, name)
                assert torch.equal(got[name], tensor), (rank, pad, name)
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0
    manifest = json.loads((out / "shardprep.json").read_text())
    jsonschema.validate(manifest, SCHEMA)
    (target,) = manifest["models"]
    assert target["experts"]["assumptions"]["mxfp4_padding"] == "at_load"
    assert "mxfp4_pad" not in manifest["request"] or manifest["request"]["mxfp4_pad"] is None
    read = read_manifest(out)
    assert read.served_topologies() == f"tp {', '.join(map(str, read.served_tps))} x any pp"
    # 5 blocks: 3 and 2 a rank at tp2; 2, 2, 1 and 0 at tp4, which tp2 would split
    assert read.served_tps == {2: (1, 2), 4: (1, 4)}[tp]
    assert read.served_backends() == (
        "every kernel backend (what a backend repacks or pads is done at load)"
    )
    card = model_card(read, "org/tiny-gpt-oss")
    assert "- serves every kernel backend (what a backend repacks or pads is done at load)" in card


def test_stacks_that_do_not_fit_the_backends_parameters_are_refused(tmp_path: Path) -> None:
    """A backend that pads nothing cannot hold a rank's whole 32-blocks when I/tp is not
    whole blocks (vLLM's own loader fails there too): one error, naming the stack."""
    model = tiny(tmp_path / "model")
    convert(str(model), tmp_path / "out", Options(tp=2, pp=1), progress=False)
    ours = load_file(tmp_path / "out" / "shards" / "model-pp-0-tp-0-part-0.safetensors")
    unpadded = {  # I/tp = 80 rows, where rank 0 holds 96
        "w13_weight": torch.zeros(E, 160, H // 2, dtype=torch.uint8),
        "w2_bias": torch.zeros(E, H, dtype=torch.bfloat16),
    }
    with pytest.raises(WeightMismatchError) as info:
        padded_at_load(ours, unpadded)
    assert "1 shape mismatch(es) (w13_weight: file (4, 192, 48), model (4, 160, 48))" in str(
        info.value
    )


def tiny(folder: Path) -> Path:
    return make_tiny_model(
        folder, GPT_OSS, quantization_config=TINY_MXFP4, hidden_size=H, intermediate_size=INTER,
        num_hidden_layers=2, num_key_value_heads=4, num_local_experts=E,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tp", "pad"), [(2, "64"), (2, "128,128"), (4, "128,256"), (4, "256,256"), (4, "32")]
)
def test_a_baked_padding_equals_vllms_loading(tmp_path: Path, tp: int, pad: str) -> None:
    model = tiny(tmp_path / "model")
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=tp, pp=1, mxfp4_pad=pad), progress=False)
    source = load_file(model / "model.safetensors")
    for rank in range(tp):
        ours = load_file(out / "shards" / f"model-pp-0-tp-{rank}-part-0.safetensors")
        for name, expected in vllm_state(source, tp, rank, Mxfp4Pad.parse(pad)).items():
            got = ours[ROUTED + name]
            assert got.dtype == expected.dtype and torch.equal(got, expected), (rank, name)
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0
    manifest = json.loads((out / "shardprep.json").read_text())
    jsonschema.validate(manifest, SCHEMA)
    (target,) = manifest["models"]
    assert target["experts"]["assumptions"]["mxfp4_padding"] == pad
    assert manifest["request"]["mxfp4_pad"] == pad
    assert manifest["vllm_layout"]["revisions"]["mxfp4"] == 1
    # another tp pads other sizes: the artifact serves its own topology only
    assert read_manifest(out).served_topologies() == (
        f"tp{tp} x pp1 only (its MXFP4 experts are padded for tp{tp})"
    )
    assert read_manifest(out).served_backends() == (
        f"the MXFP4 MoE backends whose padding holds the baked-in --mxfp4-pad {pad} (the same "
        "or coarser alignments)"
    )


def test_the_last_ranks_may_hold_fewer_blocks_or_none() -> None:
    assert [mx_range(160, 4, r) for r in range(4)] == [(0, 64), (64, 128), (128, 160), (160, 160)]
    assert [mx_range(96, 2, r) for r in range(2)] == [(0, 64), (64, 96)]


def test_the_option_names_the_backends_alignments() -> None:
    assert Mxfp4Pad.parse(None) is None  # none baked in: padded at load
    assert Mxfp4Pad.parse("128,256") == Mxfp4Pad(128, 256)
    assert Mxfp4Pad.parse("32").text == "32"
    with pytest.raises(ConfigError, match="--mxfp4-pad '48' is not an alignment"):
        Mxfp4Pad.parse("48")


def test_cli_plan_shows_the_scheme_and_refuses_what_vllm_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny(tmp_path / "model")
    assert main(["plan", "--tp", "2", "--mxfp4-pad", "128,256", str(model)]) == 0
    out = capsys.readouterr().out
    assert "quantization: gpt_oss_mxfp4 (mxfp4)" in out
    odd = make_tiny_model(
        tmp_path / "odd", GPT_OSS, quantization_config=TINY_MXFP4, intermediate_size=80,
        num_hidden_layers=2,
    )  # fmt: skip
    assert main(["plan", "--tp", "2", str(odd)]) == 1
    err = capsys.readouterr().err
    assert "MXFP4 stores intermediate_size (80) in blocks of 32, which it does not divide" in err


def test_the_option_is_refused_where_nothing_is_mxfp4(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", GPT_OSS, num_hidden_layers=2)
    with pytest.raises(PlanError) as caught:
        convert(str(model), tmp_path / "out", Options(tp=2, pp=1, mxfp4_pad="32"), progress=False)
    assert str(caught.value) == (
        "cannot convert: --mxfp4-pad 32 matters only to MXFP4 checkpoints (quant_method "
        "mxfp4); leave it out"
    )


def test_the_tiny_models_mxfp4_is_a_real_e2m1_e8m0_encoding() -> None:
    from shardprep.demo.fp4 import mxfp4_decode, mxfp4_encode

    weight = 0.05 * torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_encode(weight)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert tuple(blocks.shape) == (3, 8, 2, 16) and tuple(scales.shape) == (3, 8, 2)
    decoded = mxfp4_decode(blocks, scales)
    # within half a step of e2m1 at each group's scale (the largest step is 2 of 6)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert bool(((decoded - weight).abs() <= step + 1e-6).all())
    assert torch.equal(mxfp4_decode(*mxfp4_encode(decoded)), decoded)  # exact values stay
    # gpt-oss's layout: code 0x2 (1.0) in the low nibble, 0xA (-1.0) in the high one
    one_group = torch.tensor([[[0xA2] + [0] * 15]], dtype=torch.uint8)
    exponent = torch.tensor([[127]], dtype=torch.uint8)
    assert mxfp4_decode(one_group, exponent)[0, :3].tolist() == [1.0, -1.0, 0.0]
