"""A checkpoint whose architecture no family names, converted with the layout derived from
vLLM (plan/derived): Qwen3.5-MoE's text-only class `Qwen3_5MoeForCausalLM`, as
transformers saves it (each expert's projections apart, the DeltaNet's `in_proj_qkv` and
`in_proj_z` apart) with the `mtp.*` layer its published checkpoints carry, at tp2 x pp2.
Its rank files hold vLLM's fused parameters, made of the rank's rows of each part
(`Qwen3_5Model.hf_to_vllm_mapper`: in_proj_qkv as shards 0, 1, 2 and in_proj_z as 3 of
in_proj_qkvz; FusedMoE's w13 as the rank's gate rows, then its up rows); its MTP draft
(`Qwen3_5MoeMTP`) is on the last stage only, without the lm_head vLLM shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from derived_mtp import QWEN35, make_mtp_model
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest
from shardprep.plan.derived import available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not available(), reason="deriving needs vLLM installed"),
]
LAYER = "model.layers.0."
KEY, VALUE = 2 * 128, 4 * 128  # the DeltaNet's key and value heads times their dims


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen35-text")
    model = make_mtp_model(root / "model", QWEN35)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", vllm_env.with_torchvision()["PYTHONPATH"])
        convert(str(model), root / "out", Options(tp=2, pp=2, dtype="float32"), progress=False)
    return model, root / "out"


def rank_file(out: Path, role: str, pp: int, tp: int) -> dict[str, torch.Tensor]:
    (entry,) = read_manifest(out).rank_files(role, pp, tp)
    return load_file(out / entry.path)


@pytest.mark.parametrize("tp", [0, 1])
def test_the_text_only_class_holds_vllms_fused_rows_of_the_separate_tensors(
    converted: tuple[Path, Path], tp: int
) -> None:
    model, out = converted
    manifest = read_manifest(out)
    assert manifest.vllm_layout.revisions == {"derived": 1}
    assert [(m.role, m.architecture) for m in manifest.models] == [
        ("target", QWEN35),
        ("draft", "mtp"),
    ]
    source, rank = load_file(model / "model.safetensors"), rank_file(out, "target", 0, tp)

    def mine(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.chunk(2, dim=dim)[tp]

    qkv = source[LAYER + "linear_attn.in_proj_qkv.weight"]
    q, k, v = qkv[:KEY], qkv[KEY : 2 * KEY], qkv[2 * KEY :]
    assert v.shape[0] == VALUE
    z = source[LAYER + "linear_attn.in_proj_z.weight"]
    expected = torch.cat([mine(q), mine(k), mine(v), mine(z)])
    assert torch.equal(rank[LAYER + "linear_attn.in_proj_qkvz.weight"], expected)
    experts = LAYER + "mlp.experts."
    w13 = rank[experts + "routed_experts.w13_weight"]
    w2 = rank[experts + "routed_experts.w2_weight"]
    assert w13.shape[0] == w2.shape[0] == 4
    for e in range(4):
        gate, up = source[f"{experts}{e}.gate_proj.weight"], source[f"{experts}{e}.up_proj.weight"]
        assert torch.equal(w13[e], torch.cat([mine(gate), mine(up)]))
        assert torch.equal(w2[e], mine(source[f"{experts}{e}.down_proj.weight"], 1))


def test_its_mtp_draft_is_on_the_last_stage_without_the_shared_lm_head(
    converted: tuple[Path, Path],
) -> None:
    model, out = converted
    manifest = read_manifest(out)
    assert manifest.model("draft").shared_with_target == ("lm_head.weight",)
    assert {e.pp for e in manifest.files if e.role == "draft"} == {1}
    source, draft = load_file(model / "model.safetensors"), rank_file(out, "draft", 1, 1)
    assert torch.equal(draft["model.fc.weight"], source["mtp.fc.weight"].chunk(2)[1])
    gate = source["mtp.layers.0.mlp.experts.3.gate_proj.weight"]
    w13 = draft["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert torch.equal(w13[3, : gate.shape[0] // 2], gate.chunk(2)[1])
    assert "lm_head.weight" not in draft
    first, last = rank_file(out, "target", 0, 0), rank_file(out, "target", 1, 0)
    assert "lm_head.weight" not in first
    assert torch.equal(last["lm_head.weight"][:512], source["lm_head.weight"][:512])
