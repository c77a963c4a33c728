"""DeepSeek-V3 MTP drafts: the MTP layers of the target checkpoint become the artifact's
draft by themselves, named as vLLM's DeepSeekMTP names them, on the last stage."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from artifacts import rank_tensors
from safetensors.torch import load_file, save_file
from schema import SCHEMA

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import TINY_FP8, make_tiny_model, tiny_config
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

V3 = "DeepseekV3ForCausalLM"
MTP = "model.layers.3."  # with three decoder layers, the MTP layer is layer 3


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mtp")
    return make_tiny_model(root / "model", V3, num_hidden_layers=3, num_nextn_predict_layers=1)


def test_convert_makes_the_mtp_layer_the_draft_on_the_last_stage(
    mtp_model: Path, tmp_path: Path
) -> None:
    artifact = tmp_path / "artifact"
    manifest = convert(str(mtp_model), artifact, Options(tp=2, pp=2), progress=False)
    jsonschema.validate(json.loads((artifact / "shardprep.json").read_text()), SCHEMA)
    draft, target = manifest.model("draft"), manifest.model("target")
    assert (draft.method, draft.folder, draft.num_layers) == ("mtp", "draft", 3)
    assert draft.source.files == target.source.files  # read once, recorded for both
    assert {(f.pp, f.tp) for f in manifest.files if f.role == "draft"} == {(1, 0), (1, 1)}
    source = load_file(mtp_model / "model.safetensors")
    ours = rank_tensors(artifact, "draft", 1, 1)
    block = MTP + "mtp_block."
    assert {n for n in ours if not n.startswith(block)} == {
        MTP + "enorm.weight",
        MTP + "hnorm.weight",
        MTP + "eh_proj.weight",
        MTP + "shared_head.norm.weight",
        "model.embed_tokens.weight",
    }
    assert torch.equal(ours[MTP + "eh_proj.weight"], source[MTP + "eh_proj.weight"])
    assert ours[block + "self_attn.fused_qkv_a_proj.weight"].shape == (128 + 512 + 64, 128)
    assert ours[block + "mlp.experts.routed_experts.w13_weight"].shape == (8, 256, 128)
    assert ours[block + "mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # vLLM loads the MTP layer's own copy of the embedding (it overwrites the top-level one).
    embed = ours["model.embed_tokens.weight"]
    # Vocabulary 1000 padded to 1024: rank 1 holds rows 512-999, then zeros.
    assert torch.equal(embed[:488], source[MTP + "embed_tokens.weight"][512:])
    assert not embed[488:].any()
    for p in range(2):
        for t in range(2):
            assert not [n for n in rank_tensors(artifact, "target", p, t) if n.startswith(MTP)]


def test_at_pp1_the_draft_leaves_the_embedding_and_head_to_the_target(mtp_model: Path) -> None:
    config = tiny_config(V3, num_hidden_layers=3, num_nextn_predict_layers=1)
    tensors = load_file(mtp_model / "model.safetensors")
    source = SourceModel(config, {n: ("BF16", tuple(t.shape)) for n, t in tensors.items()})
    plan = make_plan(source, ConversionRequest(tp=1, pp=1, draft_method="mtp"), source)
    draft = plan.models[1]
    assert draft.shared_with_target == (
        "model.embed_tokens.weight",
        MTP + "shared_head.head.weight",
    )
    names = {t.name for f in plan.files if f.role == "draft" for t in f.tensors}
    assert "model.embed_tokens.weight" not in names and MTP + "enorm.weight" in names


def test_fp8_mtp_layers_stay_fp8_but_eh_proj_does_not() -> None:
    config = tiny_config(
        V3, num_hidden_layers=3, num_nextn_predict_layers=1, quantization_config=TINY_FP8
    )
    from shardprep.plan import archs
    from shardprep.plan.archs.parts import quantized

    shapes, dtypes = {}, {}
    for family in (archs.target_family(config)[1], archs.draft_family("mtp", "deepseek")):
        shapes |= quantized.expected_shapes(family, config)
        dtypes |= quantized.source_dtypes(family, config)
    source = SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})
    plan = make_plan(source, ConversionRequest(tp=2, pp=1, draft_method="mtp"), source)
    ours = {t.name: t for f in plan.files if (f.role, f.tp) == ("draft", 0) for t in f.tensors}
    assert ours[MTP + "mtp_block.self_attn.o_proj.weight"].dtype == "F8_E4M3"
    assert ours[MTP + "mtp_block.self_attn.o_proj.weight_scale_inv"].dtype == "F32"
    assert ours[MTP + "eh_proj.weight"].dtype == "BF16"


def test_no_mtp_leaves_the_draft_out(mtp_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["convert", "--tp", "2", str(mtp_model), "-o", str(out), "--no-mtp", "-q"]) == 0
    manifest = read_manifest(out)
    assert manifest.model("draft") is None and not (out / "draft").exists()
    for key in manifest.model("target").ranks.values():
        assert not [name for name in key if name.startswith(MTP)]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "an MTP layer, which the MTP draft holds"),
        (["--no-mtp"], "vLLM loads it only as the MTP draft, which --no-mtp or another --draft"),
    ],
)
def test_plan_says_where_the_mtp_layer_went(
    mtp_model: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    assert main(["plan", "--tp", "2", str(mtp_model), *flags]) == 0
    left_out = [line for line in capsys.readouterr().out.splitlines() if "left out" in line]
    assert says in left_out[0]  # the target's line comes first
    assert left_out[0].startswith(f"  left out: 44 tensors, e.g. {MTP}eh_proj.weight: an MTP layer")


def test_the_checkpoint_is_read_once_for_target_and_draft(
    mtp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardprep.convert import scatter

    reads: list[tuple[list[str], tuple[str, ...]]] = []
    original = scatter._scatter_hashed

    def counting(reader, mover, checkpoint, roles, files, *rest):  # type: ignore[no-untyped-def]
        reads.append((files, roles))
        return original(reader, mover, checkpoint, roles, files, *rest)

    monkeypatch.setattr(scatter, "_scatter_hashed", counting)
    convert(str(mtp_model), tmp_path / "artifact", Options(tp=2, pp=2), progress=False)
    assert reads == [(["model.safetensors"], ("target", "draft"))]


def test_a_promised_mtp_layer_the_checkpoint_lacks_converts_the_target_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' save_pretrained keeps num_nextn_predict_layers but drops the MTP
    layers: the target converts, and one line says there is no MTP draft."""
    model = make_tiny_model(tmp_path / "m", V3, num_hidden_layers=3, num_nextn_predict_layers=1)
    tensors = load_file(model / "model.safetensors")
    save_file(
        {n: t for n, t in tensors.items() if not n.startswith(MTP)}, model / "model.safetensors"
    )
    out = tmp_path / "out"
    assert main(["convert", str(model), "-o", str(out), "--tp", "2", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert (
        "note: config.json promises a mtp draft inside the checkpoint, which holds none of "
        "its tensors: the target is converted without a mtp draft"
    ) in text
    manifest = read_manifest(out)
    assert manifest.model("draft") is None and manifest.request.mtp_draft


@pytest.mark.parametrize("pp", [1, 2])
def test_a_draft_copy_is_left_out_only_when_its_bytes_equal_the_targets(
    mtp_model: Path, tmp_path: Path, pp: int
) -> None:
    """vLLM 0.33's runner shares a draft module only when the weights are equal: an MTP
    head or embedding that differs from the target's is written to the draft."""
    same = convert(str(mtp_model), tmp_path / "same", Options(tp=2, pp=pp), progress=False)
    draft = same.model("draft")
    assert MTP + "shared_head.head.weight" in draft.shared_with_target
    assert ("model.embed_tokens.weight" in draft.shared_with_target) == (pp == 1)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_bytes((mtp_model / "config.json").read_bytes())
    tensors = load_file(mtp_model / "model.safetensors")
    for name in (MTP + "shared_head.head.weight", MTP + "embed_tokens.weight"):
        tensors[name] = tensors[name] + 1
    save_file(tensors, model / "model.safetensors")
    other = convert(str(model), tmp_path / "other", Options(tp=2, pp=pp), progress=False)
    draft = other.model("draft")
    assert draft.shared_with_target == ()
    held = rank_tensors(tmp_path / "other", "draft", pp - 1, 0)
    head, mine = tensors[MTP + "shared_head.head.weight"], held[MTP + "shared_head.head.weight"]
    rows = min(head.shape[0], mine.shape[0])  # tp rank 0's rows of the padded vocabulary
    assert torch.equal(mine[:rows], head[:rows])
    assert "model.embed_tokens.weight" in held
    assert verify(tmp_path / "other", full=True, progress=False).ok
