"""Kimi-K3's MTP draft (vLLM's `KimiK3MTP`), planned and converted without vLLM: the rules
on the bytes of a tiny bfloat16 Kimi-K3 with one MTP layer, what decides the layer's kind,
and what is refused (tests/vllm/test_vllm_kimi_k3_dspark.py holds vLLM's own state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from artifacts import rank_tensors
from safetensors.torch import load_file, save_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert, load_and_plan
from shardprep.convert.verify import verify
from shardprep.demo.quant_configs import KIMI_K3_MXFP4
from shardprep.demo.tiny import make_tiny_model, tiny_config
from shardprep.errors import ShardprepError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

KIMI = "KimiK3ForConditionalGeneration"
SRC = "language_model.model.layers.4."  # the MTP layer of the 4-layer tiny Kimi-K3
MTP = "model.layers.4."
BLOCK = MTP + "mtp_block."
EMBED = "language_model.model.embed_tokens.weight"
HEAD = "language_model.lm_head.weight"


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("k3-mtp")
    return make_tiny_model(
        root / "m", KIMI, torch_dtype="bfloat16", vocab_size=250, num_nextn_predict_layers=1
    )


def implied(config: dict) -> SourceModel:
    """The checkpoint the config implies: the target's tensors and the MTP layers'."""
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    shapes = quantized.expected_shapes(family, read)
    dtypes = quantized.source_dtypes(family, read)
    mtp = archs.draft_family("mtp", family.name)
    shapes |= quantized.expected_shapes(mtp, read)
    dtypes |= quantized.source_dtypes(mtp, read)
    return SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})


def test_the_mtp_layer_is_the_draft_on_the_last_stage_cut_as_vllm_loads_it(
    mtp_model: Path, tmp_path: Path
) -> None:
    """tp2 x pp2: the decoder block (layer 4: MLA with experts) under `mtp_block.`, the
    gate fused into `fused_qkv_a_g_proj` by rank, `eh_proj` and the norms whole, the
    expert stacks by rank; the draft's own embedding from the layer's copy (250 tokens:
    rank 1 holds 122 and 6 zero rows); the head left to the target's lm_head."""
    src = load_file(mtp_model / "model.safetensors")
    convert(str(mtp_model), tmp_path / "a", Options(tp=2, pp=2), progress=False)
    manifest = read_manifest(tmp_path / "a")
    assert {(f.pp, f.tp) for f in manifest.files if f.role == "draft"} == {(1, 0), (1, 1)}
    draft = manifest.model("draft")
    assert draft.method == "mtp" and draft.shared_with_target == (MTP + "shared_head.head.weight",)
    target = rank_tensors(tmp_path / "a", "target", 1, 0)
    assert not any(".layers.4." in name for name in target)
    for t in (0, 1):
        ours = rank_tensors(tmp_path / "a", "draft", 1, t)
        assert not any("_res_" in name for name in ours)
        rows = slice(t * 32, (t + 1) * 32)  # 4 heads x 16 of v_head_dim, 2 heads a rank
        fused = torch.cat(
            [
                src[SRC + "self_attn.q_a_proj.weight"],
                src[SRC + "self_attn.kv_a_proj_with_mqa.weight"],
                src[SRC + "self_attn.g_proj.weight"][rows],
            ]
        )
        assert torch.equal(ours[BLOCK + "self_attn.fused_qkv_a_g_proj.weight"], fused)
        assert torch.equal(
            ours[BLOCK + "self_attn.o_proj.weight"], src[SRC + "self_attn.o_proj.weight"][:, rows]
        )
        assert torch.equal(ours[MTP + "eh_proj.weight"], src[SRC + "eh_proj.weight"])
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            assert torch.equal(ours[MTP + name], src[SRC + name])
        experts = SRC + "block_sparse_moe.experts."
        inter = slice(t * 16, (t + 1) * 16)  # 32 intermediate rows of each expert
        w13 = ours[BLOCK + "block_sparse_moe.experts.routed_experts.w13_weight"]
        for e in range(8):
            gate_up = [src[f"{experts}{e}.w1.weight"][inter], src[f"{experts}{e}.w3.weight"][inter]]
            assert torch.equal(w13[e], torch.cat(gate_up))
        bias = ours[BLOCK + "block_sparse_moe.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        embed, copy = ours["model.embed_tokens.weight"], src[SRC + "embed_tokens.weight"]
        real = min(128, 250 - t * 128)
        assert embed.shape == (128, 64)
        assert torch.equal(embed[:real], copy[t * 128 : t * 128 + real])
        assert not embed[real:].any()
    assert verify(tmp_path / "a", full=True, progress=False).ok


def test_at_pp1_the_draft_leaves_embedding_and_head_to_the_target(
    mtp_model: Path, tmp_path: Path
) -> None:
    convert(str(mtp_model), tmp_path / "a", Options(tp=2, pp=1), progress=False)
    draft = read_manifest(tmp_path / "a").model("draft")
    assert set(draft.shared_with_target) == {
        "model.embed_tokens.weight",
        MTP + "shared_head.head.weight",
    }
    plan, _ = load_and_plan(str(mtp_model), Options(tp=2, pp=1))
    skipped = dict(plan.models[1].skipped)
    assert dict(plan.models[0].skipped)[SRC + "eh_proj.weight"] == (
        "an MTP layer, which the MTP draft holds"
    )
    assert skipped[SRC + "embed_tokens.weight"].startswith(f"equal to {EMBED}, byte for byte")
    assert skipped[HEAD] == "a tensor of the target"
    ours = rank_tensors(tmp_path / "a", "draft", 0, 1)
    assert "model.embed_tokens.weight" not in ours and MTP + "eh_proj.weight" in ours


def test_a_head_copy_that_differs_from_lm_head_is_written(mtp_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_bytes((mtp_model / "config.json").read_bytes())
    tensors = load_file(mtp_model / "model.safetensors")
    tensors[SRC + "shared_head.head.weight"] = tensors[SRC + "shared_head.head.weight"] + 1
    save_file(tensors, model / "model.safetensors")
    convert(str(model), tmp_path / "a", Options(tp=2, pp=1), progress=False)
    assert read_manifest(tmp_path / "a").model("draft").shared_with_target == (
        "model.embed_tokens.weight",
    )
    head = rank_tensors(tmp_path / "a", "draft", 0, 1)[MTP + "shared_head.head.weight"]
    assert torch.equal(head[:122], tensors[SRC + "shared_head.head.weight"][128:])


def test_the_layer_index_decides_kda_or_mla_and_experts_or_dense() -> None:
    """vLLM builds MTP layer L as decoder layer L of the target's rules."""
    kda = tiny_config(KIMI, num_nextn_predict_layers=1)
    kda["text_config"]["linear_attn_config"]["kda_layers"] = [1, 3, 5]  # 1-based: layer 4
    kda["text_config"]["moe_layer_freq"] = 3  # 4 % 3: dense
    source = implied(kda)
    plan = make_plan(source, ConversionRequest(tp=2, pp=1, draft_method="mtp"), source)
    draft = {t.name for f in plan.files if f.role == "draft" for t in f.tensors}
    assert BLOCK + "self_attn.in_proj_qkvgfab.weight" in draft
    assert BLOCK + "self_attn.conv1d.weight" in draft
    assert BLOCK + "mlp.gate_up_proj.weight" in draft
    assert not any("fused_qkv_a" in name or "experts" in name for name in draft)


def test_no_mtp_leaves_the_draft_out(mtp_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    assert main(["convert", "--tp", "2", str(mtp_model), "-o", str(out), "--no-mtp", "-q"]) == 0
    assert read_manifest(out).model("draft") is None
    plan, _ = load_and_plan(str(mtp_model), Options(tp=2, pp=1, mtp_draft=False))
    skipped = dict(plan.models[0].skipped)
    assert skipped[SRC + "eh_proj.weight"].startswith("an MTP layer; vLLM loads it only as")


def test_a_promised_mtp_layer_the_checkpoint_lacks_converts_the_target_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", KIMI, num_nextn_predict_layers=1)
    tensors = load_file(model / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if SRC not in n}, model / "model.safetensors")
    assert main(["convert", str(model), "-o", str(tmp_path / "a"), "--tp", "2", "-q"]) == 0
    assert "holds none of its tensors: the target is converted without a mtp draft" in (
        capsys.readouterr().out
    )
    assert read_manifest(tmp_path / "a").model("draft") is None


def test_what_vllm_would_leave_unset_or_is_not_proven_is_refused_in_one_line(
    mtp_model: Path, tmp_path: Path
) -> None:
    tensors = load_file(mtp_model / "model.safetensors")
    config = (mtp_model / "config.json").read_bytes()
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "config.json").write_bytes(config)
    del tensors[SRC + "embed_tokens.weight"]
    save_file(tensors, lacking / "model.safetensors")
    convert(str(lacking), tmp_path / "pp1", Options(tp=2, pp=1), progress=False)  # shared
    with pytest.raises(ShardprepError, match=r"at pp > 1 .* fills it from .*embed_tokens"):
        convert(str(lacking), tmp_path / "pp2", Options(tp=2, pp=2), progress=False)
    two = tiny_config(KIMI, num_nextn_predict_layers=2)
    source = implied(tiny_config(KIMI, num_nextn_predict_layers=1))
    with pytest.raises(ShardprepError, match="holds no tensor of MTP layer 5"):
        mine = SourceModel(two, source.tensors)
        make_plan(mine, ConversionRequest(tp=2, pp=1, draft_method="mtp"), mine)
    mxfp4 = tiny_config(
        KIMI,
        num_nextn_predict_layers=1,
        quantization_config=dict(KIMI_K3_MXFP4),
        moe_intermediate_size=256,
        routed_expert_hidden_size=256,
    )
    quant = implied(mxfp4)
    with pytest.raises(ShardprepError, match="MTP layers are laid out for bfloat16 .* --no-mtp"):
        make_plan(quant, ConversionRequest(tp=2, pp=1, draft_method="mtp"), quant)
