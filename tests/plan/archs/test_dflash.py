"""DFlash and DSpark drafts without vLLM: detection, layout, the mask-embedding side
file, and the one-line errors for drafts that cannot be told or do not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_draft, tiny_config, write_mask_embedding
from shardprep.errors import ConfigError, PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

TARGET = tiny_config("Qwen3ForCausalLM", num_hidden_layers=6, vocab_size=1000)
DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3, 5]},
}
DSPARK = {
    **DFLASH,
    "architectures": ["Qwen3DSparkModel"],
    "markov_rank": 16,
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}
DSPARK.pop("dflash_config")
OPTIONAL = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "mask_embedding")


def draft_source(method: str, config: dict[str, Any], drop=OPTIONAL, **extra) -> SourceModel:
    shapes = archs.draft_family(method, "llama").expected_shapes(
        config, PlanContext(target_config=TARGET)
    )
    tensors = {n: ("BF16", s) for n, s in shapes.items() if n not in drop}
    tensors.update(extra)
    return SourceModel(config, tensors)


def target_source() -> SourceModel:
    _, family = archs.target_family(TARGET)
    return SourceModel(TARGET, {n: ("BF16", s) for n, s in family.expected_shapes(TARGET).items()})


def draft_tensors(plan, tp_rank: int) -> dict[str, Any]:
    files = [f for f in plan.files if f.role == "draft" and f.tp == tp_rank]
    return {t.name: t for f in files for t in f.tensors}


def test_dflash_layout_at_tp2_pp2() -> None:
    plan = make_plan(target_source(), ConversionRequest(tp=2, pp=2), draft_source("dflash", DFLASH))
    assert {f.pp for f in plan.files if f.role == "draft"} == {1}
    draft = draft_tensors(plan, 1)
    # Local layer indices; fused q/k/v (KV heads split), replicated fc and norms.
    assert draft["model.layers.1.self_attn.qkv_proj.weight"].shape == (64 + 32 + 32, 128)
    assert draft["model.layers.1.self_attn.o_proj.weight"].shape == (128, 64)
    assert draft["model.fc.weight"].shape == (128, 3 * 128)
    assert draft["model.hidden_norm.weight"].shape == (128,)
    assert not any(name.startswith("model.layers.6") for name in draft)
    # Embedding and lm_head absent: vLLM shares the target's, which pp2 keeps on stage 1.
    assert {"model.embed_tokens.weight", "lm_head.weight"}.isdisjoint(draft)
    model = next(m for m in plan.models if m.role == "draft")
    assert model.method == "dflash"
    assert set(model.shared_with_target) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert ("model.embed_tokens.weight", 1) in dict.fromkeys(plan.models[0].spec_decode_only)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_attention_sink_bias_is_split_like_the_heads(tp: int) -> None:
    config = {**DFLASH, "dflash_config": {**DFLASH["dflash_config"], "attention_sink_bias": True}}
    plan = make_plan(
        target_source(), ConversionRequest(tp=tp, pp=1), draft_source("dflash", config)
    )
    for rank in range(tp):
        sink = draft_tensors(plan, rank)["model.layers.1.self_attn.attention_sink_bias"]
        assert sink.shape == (4 // tp,)
        assert [(b.source, b.rows) for b in sink.blocks] == [
            ("layers.1.self_attn.attention_sink_bias", (rank * 4 // tp, (rank + 1) * 4 // tp))
        ]


def test_attention_sink_bias_the_config_does_not_enable_is_one_line() -> None:
    config = {**DFLASH, "dflash_config": {**DFLASH["dflash_config"], "attention_sink_bias": True}}
    tensors = draft_source("dflash", config).tensors
    with pytest.raises(PlanError, match="does not enable them.*attention_sink_bias to true"):
        make_plan(target_source(), ConversionRequest(tp=2, pp=1), SourceModel(DFLASH, tensors))


def test_dspark_heads_are_replicated_and_the_confidence_head_float32() -> None:
    extra = {"embed_tokens.weight": ("BF16", (1000, 128)), "lm_head.weight": ("BF16", (1000, 128))}
    source = draft_source("dspark", DSPARK, **extra)
    plan = make_plan(target_source(), ConversionRequest(tp=2, pp=1), source)
    ranks = [draft_tensors(plan, r) for r in range(2)]
    for rank in ranks:
        assert rank["model.markov_head.markov_w1.weight"].shape == (1000, 16)
        w2 = rank["model.markov_head.markov_w2.weight"]
        assert w2.shape == (1024, 16)  # padded to 64, not split
        assert [b.rows for b in w2.blocks] == [(0, 1000), (0, 24)]
        assert rank["model.confidence_head.proj.weight"].dtype == "F32"
        assert rank["model.confidence_head.proj.bias"].shape == (1,)
        assert rank["model.layers.0.self_attn.q_norm.weight"].dtype == "BF16"
        assert rank["lm_head.weight"].shape == (512, 128)  # the draft's head is split
    assert "model.mask_embedding" not in ranks[0]  # DSpark never reads one


def test_dspark_without_an_enabled_confidence_head_drops_its_tensors() -> None:
    config = {**DSPARK, "enable_confidence_head": False}
    extra = {
        "confidence_head.proj.weight": ("F32", (1, 144)),
        "confidence_head.proj.bias": ("F32", (1,)),
    }
    plan = make_plan(
        target_source(), ConversionRequest(tp=1, pp=1), draft_source("dspark", config, **extra)
    )
    assert not any("confidence" in name for name in draft_tensors(plan, 0))
    skipped = dict(next(m for m in plan.models if m.role == "draft").skipped)
    assert (
        skipped["confidence_head.proj.bias"]
        == "the draft config does not enable the confidence head"
    )


@pytest.mark.parametrize(
    ("config", "names", "method"),
    [
        (DFLASH, ["fc.weight", "hidden_norm.weight", "layers.0.mlp.up_proj.weight"], "dflash"),
        ({}, ["fc.weight", "hidden_norm.weight", "layers.0.mlp.up_proj.weight"], "dflash"),
        ({}, ["markov_head.markov_w1.weight", "hidden_norm.weight", "fc.weight"], "dspark"),
        (DSPARK, ["fc.weight", "hidden_norm.weight"], "dspark"),
        ({}, ["fc.weight", "layers.0.mlp.up_proj.weight"], "eagle"),
        ({}, ["midlayer.mlp.up_proj.weight", "d2t", "fc.weight"], "eagle3"),
    ],
)
def test_draft_kind_from_config_and_tensors(config, names, method) -> None:
    assert archs.detect_draft_method(config, names, "llama") == method


def test_a_draft_whose_kind_cannot_be_told_is_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        archs.detect_draft_method({}, ["norm.weight", "lm_head.weight"], "llama")
    assert str(info.value) == (
        "cannot tell which kind of draft this is from its config and tensors; pass "
        "--draft-method (dflash, dspark, eagle, eagle3)"
    )


def test_a_draft_that_does_not_fit_its_target_is_one_line() -> None:
    narrow = {**TARGET, "hidden_size": 96, "head_dim": 24}
    _, family = archs.target_family(narrow)
    target = SourceModel(
        narrow, {n: ("BF16", s) for n, s in family.expected_shapes(narrow).items()}
    )
    beyond = {**DFLASH, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 6]}}
    with pytest.raises(PlanError) as info:
        make_plan(target, ConversionRequest(tp=1, pp=1), draft_source("dflash", beyond))
    assert str(info.value) == (
        "cannot convert: draft: its target_layer_ids [6] name layers the target does not have "
        "(6 layers); pair the draft with the target it was trained for; draft: fc.weight has "
        "shape [128, 256] but config.json implies [128, 192]"
    )


def test_reduced_vocabulary_dspark_needs_its_head_and_table() -> None:
    config = {**DSPARK, "draft_vocab_size": 512}
    with pytest.raises(PlanError, match=r"smaller than the target's \(1000\) but it lacks "):
        make_plan(target_source(), ConversionRequest(tp=1, pp=1), draft_source("dspark", config))


# --- converting real bytes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from shardprep.demo.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("dflash")
    model = make_tiny_model(root / "target", "Qwen3ForCausalLM", num_hidden_layers=4)
    draft = make_tiny_draft(root / "draft", model, "dflash", omit=("embed_tokens.weight",))
    write_mask_embedding(draft)
    return model, draft


def test_mask_embedding_side_file_becomes_a_replicated_parameter(
    dflash_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    model, draft = dflash_pair
    out = tmp_path / "out"
    manifest = convert(str(model), out, Options(tp=2, pp=1, draft=str(draft)), progress=False)
    state = torch.load(draft / "mask_embedding.pt", weights_only=True)
    for tp_rank in range(2):
        entry = manifest.rank_files("draft", 0, tp_rank)[0]
        tensors = load_file(out / entry.path)
        assert torch.equal(tensors["model.mask_embedding"], state["embedding"].to(torch.bfloat16))
    side = {e.path: e for e in manifest.extra_files}["draft/mask_embedding.pt"]
    assert (out / side.path).read_bytes() == (draft / "mask_embedding.pt").read_bytes()
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0


def test_mask_embedding_for_another_token_is_one_line(
    dflash_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    model, draft = dflash_pair
    copy = tmp_path / "draft"
    copy.mkdir()
    for path in draft.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 7
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        convert(str(model), tmp_path / "out", Options(tp=1, pp=1, draft=str(copy)), progress=False)
    assert str(info.value) == (
        f"{copy / 'mask_embedding.pt'} is for mask_token_id 3 but the draft's config.json says "
        "7; use the file that came with this draft"
    )
    assert not (tmp_path / "out").exists()


def test_cli_detects_dflash_and_refuses_a_wrong_method_in_one_line(
    dflash_pair: tuple[Path, Path], capsys
) -> None:
    model, draft = dflash_pair
    assert main(["plan", str(model), "--tp", "2", "--draft", str(draft), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [m["architecture"] for m in summary["models"]] == ["Qwen3ForCausalLM", "dflash"]
    names = {
        t["name"] for f in summary["files"] if "/draft/" in "/" + f["path"] for t in f["tensors"]
    }
    assert {"model.mask_embedding", "model.fc.weight", "lm_head.weight"} <= names
    args = ["plan", str(model), "--draft", str(draft), "--draft-method", "eagle"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardprep: error: cannot convert: draft: ")
