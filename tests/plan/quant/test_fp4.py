"""compressed-tensors `mxfp4-pack-quantized` (Kimi-K3's routed experts): the scheme's
reading of config.json, vLLM's group refusal, and a small conversion checked against the
source bytes, planned and converted without an engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import TINY_MXFP4_PACK, make_tiny_model
from shardprep.errors import PlanError
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.fp4 import Mxfp4PackQuant

V3 = "DeepseekV3ForCausalLM"
EXPERTS = "model.layers.1.mlp.experts."
ROUTED = EXPERTS + "routed_experts."


def test_the_scheme_reads_mxfp4_pack_quantized_and_refuses_w4a8() -> None:
    scheme = scheme_of({"quantization_config": TINY_MXFP4_PACK})
    assert isinstance(scheme, Mxfp4PackQuant) and not scheme.problem
    assert scheme.stored("x.weight", (64, 256)) == {
        "x.weight_packed": ((64, 128), "U8"),
        "x.weight_scale": ((64, 8), "U8"),
    }
    (group,) = TINY_MXFP4_PACK["config_groups"].values()
    w4a8 = {**group, "input_activations": {"num_bits": 8, "type": "float"}}
    refused = scheme_of({"quantization_config": {**TINY_MXFP4_PACK, "config_groups": {"g": w4a8}}})
    assert refused is not None and "8-bit activations (W4A8)" in refused.problem


def test_converted_experts_are_the_source_bytes(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, moe_intermediate_size=128,
        hidden_size=256, quantization_config=TINY_MXFP4_PACK,
    )  # fmt: skip
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    source = load_file(model / "model.safetensors")
    ours = load_file(out / "shards" / "model-pp-0-tp-1-part-0.safetensors")

    def expert(e: int, part: str) -> torch.Tensor:
        return source[f"{EXPERTS}{e}.{part}"]

    for kind in ("packed", "scale"):  # rank 1: the second half of each part's rows or K
        w13 = [
            torch.cat([expert(e, f"{p}_proj.weight_{kind}")[64:] for p in ("gate", "up")])
            for e in range(8)
        ]
        assert torch.equal(ours[ROUTED + f"w13_weight_{kind}"], torch.stack(w13))
        w2 = [expert(e, f"down_proj.weight_{kind}").chunk(2, dim=1)[1] for e in range(8)]
        assert torch.equal(ours[ROUTED + f"w2_weight_{kind}"], torch.stack(w2))
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0


def test_a_tp_that_splits_a_group_is_refused_with_the_tps_that_work(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", V3, num_hidden_layers=2, moe_intermediate_size=64,
        hidden_size=256, quantization_config=TINY_MXFP4_PACK,
    )  # fmt: skip
    with pytest.raises(PlanError) as caught:
        convert(str(model), tmp_path / "out", Options(tp=4, pp=1), progress=False)
    assert (
        "vLLM refuses mxfp4 groups of 32 at tp=4: model.layers.*.mlp.experts: MXFP4 MoE "
        "stores the intermediate size per rank (16) in groups of 32, which it does not "
        "divide. Choose a tp that works: 1, 2"
    ) in str(caught.value)
