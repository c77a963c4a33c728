"""A weight vLLM dequantizes while loading, in a layout derived from vLLM (plan/derived):
DeepSeek-V3.2 as published in fp8, its indexer's `wk` stored fp8 with block scales and
fused into the bfloat16 `wk_weights_proj` after vLLM's `scaled_dequantize`, converted as
if no family named it, with its MTP layer, at tp2 x pp2. The derivation finds which
weights vLLM dequantizes (`DerivedFamily.dequantized_sources`), convert computes them as
vLLM does, and every rank file, target and draft, holds the bytes of the family's own
conversion, which tests/vllm/test_vllm_deepseek_v32.py proves against vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardprep.convert.dequantize import dequantize
from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import TINY_FP8, make_tiny_model
from shardprep.format.manifest import read_manifest
from shardprep.plan import archs
from shardprep.plan.derived import available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not available(), reason="deriving needs vLLM installed"),
]
ARCH = "DeepseekV32ForCausalLM"
LAYERS = 4
INDEXER = "self_attn.indexer."


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("v32-fp8")
    model = make_tiny_model(
        root / "model", ARCH, num_hidden_layers=LAYERS, num_nextn_predict_layers=1,
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, n_shared_experts=2,
        quantization_config=TINY_FP8,
    )  # fmt: skip
    options = Options(tp=2, pp=2, dtype="bfloat16")
    convert(str(model), root / "family", options, progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(archs._TARGETS, ARCH)
        convert(str(model), root / "derived", options, progress=False)
    return model, root / "family", root / "derived"


def test_every_rank_file_holds_the_bytes_of_the_familys_conversion(
    converted: tuple[Path, Path, Path],
) -> None:
    _, family, derived = converted
    theirs, mine = read_manifest(family), read_manifest(derived)
    assert mine.vllm_layout.revisions == {"derived": 1, "fp8_block": 1}
    assert "derived" not in theirs.vllm_layout.revisions
    files = [(f.role, f.pp, f.tp) for f in theirs.files]
    assert sorted(files) == sorted((f.role, f.pp, f.tp) for f in mine.files)
    assert ("draft", 1, 0) in files
    for role, p, t in files:
        (a,), (b,) = theirs.rank_files(role, p, t), mine.rank_files(role, p, t)
        ours, expected = load_file(derived / b.path), load_file(family / a.path)
        assert sorted(ours) == sorted(expected), (role, p, t)
        for name, tensor in expected.items():
            assert ours[name].dtype == tensor.dtype, name
            assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.mark.parametrize(
    "role, layer, held", [("target", 2, "model.layers.2."), ("draft", LAYERS, "mtp_block.")]
)
def test_the_fused_indexer_holds_wk_dequantized_as_vllm_computes_it(
    converted: tuple[Path, Path, Path], role: str, layer: int, held: str
) -> None:
    model, _, derived = converted
    source = load_file(model / "model.safetensors")
    prefix = f"model.layers.{layer}."
    held = held if role == "target" else prefix + held  # the MTP layer's own block
    wk = source[prefix + INDEXER + "wk.weight"]
    assert wk.dtype == torch.float8_e4m3fn
    values = dequantize(torch, wk, source[prefix + INDEXER + "wk.weight_scale_inv"])
    (entry,) = read_manifest(derived).rank_files(role, 1, 1)
    fused = load_file(derived / entry.path)[held + INDEXER + "wk_weights_proj.weight"]
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused[: values.shape[0]], values)
    assert torch.equal(fused[values.shape[0] :], source[prefix + INDEXER + "weights_proj.weight"])
