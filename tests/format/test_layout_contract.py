"""The layout contract with vLLM: the manifest records which layout revision of each
family and scheme an artifact holds; the loader refuses a vLLM that builds another, one
newer than every vLLM the layout was verified with, online quantization and substituted
experts, each in one line, before it opens a rank file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardprep.constants import ENV_ALLOW_UNVERIFIED_VLLM
from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import tiny_config
from shardprep.errors import LayoutMismatchError, PlanError
from shardprep.format import vllm_layout as vl
from shardprep.format.manifest import parse_manifest, read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel

contract = pytest.importorskip("shardprep.loader.contract", reason="needs vLLM importable")


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("contract") / "out"
    convert(str(tiny.model("contract-llama")), out, Options(tp=1, pp=1), progress=False)
    return out


def test_release_numbers_ignore_local_and_dev_suffixes() -> None:
    assert vl.release("0.32.0+cpu") == (0, 32, 0)
    assert vl.release("0.33.1.dev3+g1234abc") == (0, 33, 1)
    assert vl.release("0.34+cu130") == (0, 34, 0)
    with pytest.raises(LayoutMismatchError):
        vl.release("main")


def test_the_manifest_records_the_layout_and_it_reads_back(artifact: Path) -> None:
    layout = read_manifest(artifact).vllm_layout
    assert layout == vl.VllmLayout(
        "shardprep-vllm", {"llama": 1}, ("0.32.0",), dict(vl.ASSUMPTIONS)
    )
    vl.check_layout(layout, "0.32.0+cpu", "out")


def test_a_newer_vllm_than_every_verified_one_is_refused_unless_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = vl.current_layout({"llama"})
    with pytest.raises(LayoutMismatchError) as info:
        vl.check_layout(layout, "0.33.0", "out")
    assert str(info.value) == (
        "vLLM 0.33.0 is newer than every vLLM out was verified with (0.32.0); serve it "
        f"with vLLM 0.32.0, or set {ENV_ALLOW_UNVERIFIED_VLLM}=1 to load anyway (every "
        "parameter's shape and dtype is still checked)"
    )
    monkeypatch.setenv(ENV_ALLOW_UNVERIFIED_VLLM, "1")
    vl.check_layout(layout, "0.33.0", "out")
    monkeypatch.setenv(ENV_ALLOW_UNVERIFIED_VLLM, "0")
    with pytest.raises(LayoutMismatchError):
        vl.check_layout(layout, "0.33.0", "out")


def test_another_revision_names_both_sides_what_changed_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bumped = vl.VllmRange(
        (0, 33, 0),
        {**vl.RANGES[-1].revisions, "llama": 2},
        {"llama": "gate_up_proj holds up rows before gate rows"},
    )
    monkeypatch.setattr(vl, "RANGES", (*vl.RANGES, bumped))
    monkeypatch.setattr(vl, "VERIFIED", (*vl.VERIFIED, (0, 33, 0)))
    old = vl.VllmLayout("shardprep-vllm", {"llama": 1, "fp8_block": 1}, ("0.32.0",))
    with pytest.raises(LayoutMismatchError) as info:
        vl.check_layout(old, "0.33.0", "out")
    assert str(info.value) == (
        "out holds the llama layout revision 1 but vLLM 0.33.0 builds revision 2 (gate_up_proj "
        "holds up rows before gate rows); serve it with vLLM 0.32.0, or convert it again "
        "with a shardprep that knows this vLLM"
    )
    vl.check_layout(old, "0.32.0", "out")
    new = vl.current_layout({"llama"})
    assert new.revisions == {"llama": 2} and new.verified_with == ("0.33.0",)
    vl.check_layout(new, "0.33.0", "out")
    with pytest.raises(LayoutMismatchError):
        vl.check_layout(new, "0.32.0", "out")


def test_the_old_layout_string_loads_on_the_vllm_it_names(artifact: Path) -> None:
    data = json.loads((artifact / "shardprep.json").read_text())
    data["vllm_layout"] = vl.LEGACY_LAYOUT
    del data["request"]
    for model in data["models"]:
        del model["quantization"]
    legacy = parse_manifest(json.dumps(data)).vllm_layout
    assert legacy.id == vl.LEGACY_LAYOUT
    vl.check_layout(legacy, "0.32.0+cpu", "out")
    vl.check_layout(legacy, "0.32.3", "out")
    with pytest.raises(LayoutMismatchError) as info:
        vl.check_layout(legacy, "0.33.0", "out")
    assert str(info.value) == (
        "out was converted for vLLM 0.32's parameter layout (vllm-0.32/1) but vLLM 0.33.0 is "
        "running; serve it with vLLM 0.32.x, or convert it again with this shardprep"
    )
    data["vllm_layout"] = "vllm-0.31/1"
    with pytest.raises(Exception, match="vllm_layout"):
        parse_manifest(json.dumps(data))


def test_an_unknown_layout_id_or_an_older_vllm_is_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="does not know"):
        vl.check_layout(vl.VllmLayout("other/3", {}, ("0.32.0",)), "0.32.0", "out")
    with pytest.raises(LayoutMismatchError, match="older than every vLLM"):
        vl.check_layout(vl.current_layout({"llama"}), "0.31.2", "out")


class Toy(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2, device=device)


def test_online_quantization_is_refused_before_a_file_is_read(artifact: Path) -> None:
    manifest = read_manifest(artifact)
    entry = manifest.model("target")
    with pytest.raises(LayoutMismatchError) as info:
        contract.check_quantization(artifact, manifest, entry, Toy(), "fp8")
    assert str(info.value) == (
        f"{artifact} holds unquantized weights but vLLM runs with --quantization fp8, which "
        "quantizes online into parameters a copy cannot fill; leave --quantization out, or "
        "convert a checkpoint that is already quantized that way"
    )
    with pytest.raises(LayoutMismatchError, match="proj.weight on the meta device"):
        contract.check_quantization(artifact, manifest, entry, Toy("meta"), None)
    contract.check_quantization(artifact, manifest, entry, Toy(), None)
    fp8 = dataclasses.replace(entry, quantization="fp8")
    contract.check_quantization(artifact, manifest, fp8, Toy(), "fp8")


def source(config: dict) -> SourceModel:
    shapes = archs.target_family(config)[1].expected_shapes(config)
    return SourceModel(config, {name: ("BF16", shape) for name, shape in shapes.items()})


SUBSTITUTIONS = [
    {"approximate_experts": True},
    {"compression_config": {"transform_config": {"expert_substitution": {"k": 2}}}},
]


@pytest.mark.parametrize("config", SUBSTITUTIONS)
def test_expert_substitution_is_refused_by_loader_and_plan(config: dict) -> None:
    with pytest.raises(LayoutMismatchError, match="substitute experts"):
        contract.check_substitution(Path("out"), config)
    model = tiny_config("Qwen3MoeForCausalLM", **config)
    with pytest.raises(PlanError, match="substitute experts") as info:
        make_plan(source(model), ConversionRequest(tp=1, pp=1))
    assert "remove it from config.json" in str(info.value)
    contract.check_substitution(Path("out"), {"approximate_experts": False})


def test_a_quantization_the_family_does_not_place_is_refused_up_front() -> None:
    from shardprep.plan.archs.base import Family
    from shardprep.plan.checks import loading_problems

    class Plain(Family):
        name = "plain"  # places no quantization scheme

    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert loading_problems(config, Plain()) == [
        "fp8 checkpoints (fp8_block) of the plain family are not supported yet: shardprep's "
        "layout of them is not proven against vLLM; convert an unquantized checkpoint"
    ]


def test_meta_parameters_are_what_torch_calls_meta() -> None:
    assert next(Toy("meta").parameters()).is_meta
    assert not next(Toy().parameters()).is_meta
    assert torch.empty(1, device="meta").is_meta


def test_the_installed_vllm_is_one_the_layout_canary_verified() -> None:
    """The layout canary is the byte-for-byte suite (test_vllm_layout, test_vllm_moe,
    test_vllm_deepseek, test_vllm_dflash, test_vllm_dspark, test_vllm_mtp): every family's
    rank files equal the installed vLLM's own per-rank state. This ties its verdict to the
    table: on a new vLLM, the suite passing makes adding it to VERIFIED a one-line change;
    the suite failing means the family's revision is bumped in a new range."""
    import vllm

    assert vl.release(vllm.__version__) in vl.VERIFIED, vllm.__version__


@pytest.fixture(scope="module")
def with_draft(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("contract-draft") / "out"
    model = tiny.model("contract-llama")
    draft = tiny.draft("contract-eagle3", model)
    convert(str(model), out, Options(tp=1, pp=1, draft=str(draft)), progress=False)
    return out


def edited(artifact: Path, tmp_path: Path, edit) -> Path:
    """A copy of the artifact's manifest, edited by hand, in a folder of its own."""
    data = json.loads((artifact / "shardprep.json").read_text())
    edit(data)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "shardprep.json").write_text(json.dumps(data))
    return tmp_path


def gate(folder: Path, running: str) -> None:
    """What the loader checks of the layout before it opens a rank file."""
    manifest = read_manifest(folder)
    vl.check_layout(manifest.vllm_layout, running, str(folder))
    contract.check_layout_names(folder, manifest)


def test_the_layouts_shardprep_writes_pass_the_gate(artifact: Path, with_draft: Path) -> None:
    gate(artifact, "0.32.0+cpu")
    gate(with_draft, "0.32.0+cpu")
    assert read_manifest(with_draft).vllm_layout.revisions == {"eagle3": 1, "llama": 1}


def test_an_emptied_layout_record_is_refused(
    with_draft: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def empty(data: dict) -> None:
        data["vllm_layout"]["revisions"] = {}
        data["vllm_layout"]["verified_with"] = []

    folder = edited(with_draft, tmp_path, empty)
    layout = read_manifest(folder).vllm_layout
    with pytest.raises(LayoutMismatchError) as info:
        vl.check_layout(layout, "0.32.0+cpu", str(folder))
    assert str(info.value) == (
        f"{folder}'s manifest names no vLLM release its layout was verified with; convert it "
        f"again with this shardprep, or set {ENV_ALLOW_UNVERIFIED_VLLM}=1 to load anyway "
        "(every parameter's shape and dtype is still checked)"
    )
    monkeypatch.setenv(ENV_ALLOW_UNVERIFIED_VLLM, "1")  # allows an unverified vLLM only
    vl.check_layout(layout, "0.32.0+cpu", str(folder))
    with pytest.raises(LayoutMismatchError) as info:
        contract.check_layout_names(folder, read_manifest(folder))
    assert str(info.value) == (
        f"{folder}'s manifest records no layout revision for llama (its target model), so no "
        "vLLM can be checked against it; convert it again with this shardprep"
    )


def test_a_draft_or_a_scheme_missing_from_the_revisions_is_refused(
    with_draft: Path, tmp_path: Path
) -> None:
    def no_draft(data: dict) -> None:
        del data["vllm_layout"]["revisions"]["eagle3"]

    with pytest.raises(LayoutMismatchError, match=r"for eagle3 \(its draft model\)"):
        gate(edited(with_draft, tmp_path / "draft", no_draft), "0.32.0")

    def quantized(data: dict) -> None:  # claims fp8 weights, records no fp8 layout
        next(m for m in data["models"] if m["role"] == "target")["quantization"] = "fp8"

    folder = edited(with_draft, tmp_path / "fp8", quantized)
    assert read_manifest(folder).model("target").quantization == "fp8"
    with pytest.raises(LayoutMismatchError, match=r"for fp8_block or fp8_tensor \(its target"):
        gate(folder, "0.32.0")

    def recorded(data: dict) -> None:
        quantized(data)
        data["vllm_layout"]["revisions"]["fp8_block"] = 1

    gate(edited(with_draft, tmp_path / "fp8-recorded", recorded), "0.32.0")


def test_a_far_future_claim_is_judged_by_shardprep_s_own_table(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def future(data: dict) -> None:
        data["vllm_layout"]["verified_with"] = ["99.0.0"]

    folder = edited(artifact, tmp_path, future)
    gate(folder, "0.32.0")
    with pytest.raises(LayoutMismatchError) as info:
        gate(folder, "0.40.1")
    assert str(info.value) == (
        "vLLM 0.40.1 is newer than every vLLM this shardprep was verified with (0.32.0); "
        f"serve {folder} with vLLM 0.32.0, install a shardprep verified with vLLM 0.40.1, or "
        f"set {ENV_ALLOW_UNVERIFIED_VLLM}=1 to load anyway (every parameter's shape and "
        "dtype is still checked)"
    )
    monkeypatch.setenv(ENV_ALLOW_UNVERIFIED_VLLM, "1")
    gate(folder, "0.40.1")


def test_a_verified_with_entry_that_is_no_version_blames_the_manifest(
    artifact: Path, tmp_path: Path
) -> None:
    def word(data: dict) -> None:
        data["vllm_layout"]["verified_with"] = ["0.32.0", "latest"]

    folder = edited(artifact, tmp_path, word)
    with pytest.raises(LayoutMismatchError) as info:
        gate(folder, "0.32.0")
    assert str(info.value) == (
        f"{folder}'s manifest names 'latest' among the vLLM releases its layout was verified "
        "with, which is not a release number; convert it again with this shardprep"
    )


def test_every_scheme_is_found_by_its_quantization_method() -> None:
    from shardprep.plan.quant import SCHEMES, scheme_names

    for scheme in SCHEMES:
        assert scheme.name in scheme_names(scheme.method), scheme
        assert scheme.name in vl.RANGES[-1].revisions, scheme
    for family in archs.all_families():
        assert family.name in vl.RANGES[-1].revisions, family
