"""compressed-tensors `nvfp4-pack-quantized` routed experts: the scheme's reading of
config.json, the tiny models' encoding, conversions at odd sizes checked against vLLM's
loading done by hand on the source bytes, and vLLM's group refusal, without an engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from regrouping import assemble
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.fp4 import nvfp4_decode, nvfp4_encode
from shardprep.demo.tiny import TINY_NVFP4_PACK, make_tiny_model
from shardprep.errors import PlanError
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.fp4 import Nvfp4PackQuant
from shardprep.plan.topology import ExpertSplit

V3 = "DeepseekV3ForCausalLM"
EXPERTS = "model.layers.1.mlp.experts."
ROUTED = EXPERTS + "routed_experts."
(GROUP,) = TINY_NVFP4_PACK["config_groups"].values()


def _with_group(**changes: object) -> dict:
    return {**TINY_NVFP4_PACK, "config_groups": {"g": {**GROUP, **changes}}}


def test_the_scheme_reads_nvfp4_pack_quantized_and_refuses_what_it_cannot_lay_out() -> None:
    scheme = scheme_of({"quantization_config": TINY_NVFP4_PACK})
    assert isinstance(scheme, Nvfp4PackQuant) and not scheme.problem
    assert scheme.describe == "nvfp4 groups of 16"
    assert scheme.stored("x.weight", (64, 256)) == {
        "x.weight_packed": ((64, 128), "U8"),
        "x.weight_scale": ((64, 16), "F8_E4M3"),
        "x.weight_global_scale": ((1,), "F32"),
        "x.input_global_scale": ((1,), "F32"),
    }
    a16 = scheme_of({"quantization_config": _with_group(input_activations=None)})
    assert isinstance(a16, Nvfp4PackQuant) and a16.a16 and not a16.problem
    assert not a16.places("experts") and a16.places("column")  # see test_nvfp4_linear.py
    fp8 = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    w4a8 = scheme_of({"quantization_config": _with_group(input_activations=fp8)})
    assert w4a8 is not None and "8-bit activations (W4A8)" in w4a8.problem
    weights = {**GROUP["weights"], "strategy": "group"}
    grouped = scheme_of({"quantization_config": _with_group(weights=weights)})
    assert grouped is not None and grouped.problem.startswith(
        "quantization_config is nvfp4-pack-quantized with weights strategy 'group'; "
        "shardprep supports"
    )


def test_nvfp4_encoding_decodes_to_the_weight_within_e2m1_precision() -> None:
    weight = 0.05 * torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    packed, scale, global_scale = nvfp4_encode(weight)
    assert (packed.dtype, scale.dtype, global_scale.dtype) == (
        torch.uint8, torch.float8_e4m3fn, torch.float32,
    )  # fmt: skip
    assert packed.shape == (32, 32) and scale.shape == (32, 4) and global_scale.shape == (1,)
    decoded = nvfp4_decode(packed, scale, global_scale)
    # e2m1's coarsest step is 2 of 6 at the top of a group: at most a third of its largest.
    largest = weight.reshape(32, 4, 16).abs().amax(-1, keepdim=True)
    error = (decoded - weight).reshape(32, 4, 16).abs()
    assert bool((error <= largest / 3 + 1e-6).all())
    assert float(decoded.abs().amax()) == pytest.approx(float(weight.abs().amax()), rel=0.15)


@pytest.mark.parametrize(("inter", "hidden", "tp"), [(96, 272, 2), (192, 256, 4)])
def test_converted_experts_are_vllms_stacks_of_the_source_bytes(
    tmp_path: Path, inter: int, hidden: int, tp: int
) -> None:
    """Three groups of 16 of the intermediate size a rank; a hidden size of 17 groups."""
    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, moe_intermediate_size=inter,
        hidden_size=hidden, quantization_config=TINY_NVFP4_PACK,
    )  # fmt: skip
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=tp, pp=1), progress=False)
    source = load_file(model / "model.safetensors")
    local = inter // tp

    def expert(e: int, part: str) -> torch.Tensor:
        return source[f"{EXPERTS}{e}.{part}"]

    for rank in range(tp):
        ours = load_file(out / "shards" / f"model-pp-0-tp-{rank}-part-0.safetensors")
        rows = slice(rank * local, (rank + 1) * local)
        for kind, per in (("packed", 2), ("scale", 16)):  # _load_w13 and _load_w2
            w13 = [
                torch.cat([expert(e, f"{p}_proj.weight_{kind}")[rows] for p in ("gate", "up")])
                for e in range(8)
            ]
            stack = ours[ROUTED + f"w13_weight_{kind}"]
            assert stack.dtype == w13[0].dtype and torch.equal(
                stack.view(torch.uint8), torch.stack(w13).view(torch.uint8)
            )
            cols = slice(rank * local // per, (rank + 1) * local // per)
            w2 = torch.stack([expert(e, f"down_proj.weight_{kind}")[:, cols] for e in range(8)])
            assert torch.equal(
                ours[ROUTED + f"w2_weight_{kind}"].view(torch.uint8), w2.view(torch.uint8)
            )
        for scale in ("weight_global_scale", "input_global_scale"):  # whole on every rank
            w13 = [
                torch.cat([expert(e, f"{p}_proj.{scale}") for p in ("gate", "up")])
                for e in range(8)
            ]
            assert torch.equal(ours[ROUTED + f"w13_{scale}"], torch.stack(w13))
            w2 = torch.cat([expert(e, f"down_proj.{scale}") for e in range(8)])
            assert torch.equal(ours[ROUTED + f"w2_{scale}"], w2)
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0


def test_a_tp_that_splits_a_group_of_16_is_refused_with_the_tps_that_work(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, moe_intermediate_size=96,
        hidden_size=256, quantization_config=TINY_NVFP4_PACK,
    )  # fmt: skip
    with pytest.raises(PlanError) as caught:
        convert(str(model), tmp_path / "out", Options(tp=4, pp=1), progress=False)
    assert (
        "vLLM refuses nvfp4 groups of 16 at tp=4: model.layers.*.mlp.experts: NVFP4 MoE "
        "stores the intermediate size per rank (24) in groups of 16, which it does not "
        "divide. Choose a tp that works: 1, 2"
    ) in str(caught.value)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1)])
def test_global_scale_stacks_at_every_coarser_tp(
    tp: int, new_tp: int, expert_parallel: bool
) -> None:
    """The global scales of an artifact's ranks regroup into a coarser tp's stacks: [E', 2]
    (gate, up) and [E'] (down), whichever ranks hold the experts."""
    experts = 6
    rng = np.random.default_rng(5)
    sources = {f"{p}{e}": rng.random(1, np.float32) for e in range(experts) for p in "gud"}
    w13 = tuple(Piece(f"{p}{e}", Cut.REPLICATE, expert=e) for e in range(experts) for p in "gu")
    w2 = tuple(Piece(f"d{e}", Cut.EXPERT_SCALAR, expert=e) for e in range(experts))
    split = (
        ExpertSplit(experts, tp, expert_parallel=expert_parallel),
        ExpertSplit(experts, new_tp, expert_parallel=expert_parallel),
    )
    for pieces, width in ((w13, (2,)), (w2, ())):
        for rank in range(new_tp):
            got, want, _ = assemble(pieces, sources, tp, new_tp, rank, split)
            held = len(split[1].experts(rank))
            assert got.shape == want.shape == (held, *width)
            assert np.array_equal(got, want)
