"""`shardprep verify` against artifacts an attacker rewrote whole (files, hashes and
manifest agreeing), and what it says about the stages it checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hostile import edit_manifest, rehash, rewrite_header
from safetensors.torch import load_file, save_file

from shardprep.cli import main
from shardprep.constants import MANIFEST_NAME
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.format.manifest import read_manifest

SHARD = "shards/model-pp-0-tp-0-part-0.safetensors"


@pytest.fixture(scope="module")
def artifact(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny.model("llama")
    draft = tiny.draft("eagle3", model)
    out = tmp_path_factory.mktemp("verify") / "out"
    convert(str(model), out, Options(tp=2, pp=2, draft=str(draft)), progress=False)
    return out


@pytest.fixture
def copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "copy"))


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*argv, "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and err.count("\n") == 1, err
    return err


def test_an_untouched_artifact_says_which_stages(artifact: Path, capsys) -> None:
    assert main(["verify", str(artifact), "-q"]) == 0
    assert capsys.readouterr().out.startswith("ok (stages 0, 1): 10 files")


def test_float_offsets_that_once_passed_fail_verify_and_publish(copy: Path, capsys) -> None:
    def floats(header: dict[str, Any]) -> None:
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [float(v) for v in header[name]["data_offsets"]]

    rewrite_header(copy / SHARD, floats)
    edit_manifest(copy, lambda data: rehash(copy, data))
    err = one_line_error(capsys, "verify", str(copy))
    assert f"failed verification with 1 problem(s): {copy / SHARD} gives '" in err
    assert "' data_offsets that are not two integers >= 0 [begin, end]" in err
    err = one_line_error(capsys, "publish", str(copy), "org/x", "--endpoint", "http://127.0.0.1:9")
    assert f"Refusing to publish {copy}: it fails verification" in err


def test_a_negative_dimension_with_reversed_offsets_is_refused(copy: Path, capsys) -> None:
    """The bypass: end - begin equalled numel * size once both were negative."""

    def negative(header: dict[str, Any]) -> None:
        entry = header["model.layers.0.mlp.down_proj.weight"]
        begin, end = entry["data_offsets"]
        entry["shape"] = [-entry["shape"][0], entry["shape"][1]]
        entry["data_offsets"] = [end, begin]

    rewrite_header(copy / SHARD, negative)
    edit_manifest(copy, lambda data: rehash(copy, data))
    err = one_line_error(capsys, "verify", str(copy))
    assert "gives 'model.layers.0.mlp.down_proj.weight' a shape that is not a list of" in err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(files=[]), "2 stage(s) at tp=2 need 4 ranks with files, but files"),
        (
            lambda d: d.update(files=[f for f in d["files"] if f["pp"] == 0]),
            "2 stage(s) at tp=2 need 4 ranks with files, but files lists 2",
        ),
        (lambda d: d["topology"].update(tp=0), "manifest.topology.tp must be an integer from 1"),
    ],
)
def test_a_manifest_without_its_files_fails(copy: Path, capsys, edit, message: str) -> None:
    edit_manifest(copy, edit)
    assert message in one_line_error(capsys, "verify", str(copy))


def test_a_consistently_dropped_stage_is_what_it_says(copy: Path, capsys) -> None:
    """Dropping stage 1 everywhere leaves a stage-0 artifact: verify says so."""

    def drop(data: dict[str, Any]) -> None:
        data["stages"] = [0]
        data["files"] = [f for f in data["files"] if f["pp"] == 0]
        for model in data["models"]:
            model["ranks"] = {k: v for k, v in model["ranks"].items() if k.startswith("pp0-")}

    edit_manifest(copy, drop)
    for path in copy.glob("**/model-pp-1-*"):  # files the manifest no longer lists
        path.unlink()
    assert main(["verify", str(copy), "-q"]) == 0
    assert capsys.readouterr().out.startswith("ok (stage 0 of pp=2): ")


def test_a_parameter_dropped_from_one_rank_is_found(copy: Path, capsys) -> None:
    """Gone from the file and from the manifest's list of that rank: the other tp rank of
    the stage still holds it."""
    path = copy / "shards/model-pp-0-tp-1-part-0.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})

    def drop(data: dict[str, Any]) -> None:
        target = next(m for m in data["models"] if m["role"] == "target")
        del target["ranks"]["pp0-tp1"]["model.layers.0.mlp.down_proj.weight"]
        rehash(copy, data)

    edit_manifest(copy, drop)
    err = one_line_error(capsys, "verify", str(copy))
    assert (
        "target stage 0: tp rank 1 and tp rank 0 hold different parameters "
        "(model.layers.0.mlp.down_proj.weight)" in err
    )


def test_a_relative_source_is_stored_absolute(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`verify --full` from another folder finds the source (it once read as a Hub id)."""
    shutil.copytree(tiny.model("llama"), tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "model", "-o", "out", "--tp", "2", "-q"]) == 0
    source = read_manifest(tmp_path / "out").model("target").source
    assert source.model == str(tmp_path / "model") and source.repo_id is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out"), "--full", "--json", "-q"]) == 0
    assert json.loads(capsys.readouterr().out)["round_trip_tensors"] > 0
    assert not list((tmp_path / "out").glob(".manifest-*.tmp"))
    assert (tmp_path / "out" / MANIFEST_NAME).is_file()


def test_a_rank_file_the_manifest_does_not_list_is_found(copy: Path, capsys) -> None:
    """What a killed convert of another plan left under shards/ and draft/shards/ (a rank
    file of another --max-part-size, a temporary file) is not part of the artifact."""
    shutil.copyfile(copy / SHARD, copy / "shards/model-pp-0-tp-0-part-1.safetensors")
    draft_file = next(p for p in (copy / "draft/shards").iterdir())
    (copy / "draft/shards" / (draft_file.name + ".incomplete")).write_bytes(b"half")
    err = one_line_error(capsys, "verify", str(copy))
    assert "shards/model-pp-0-tp-0-part-1.safetensors, draft/shards/" in err
    assert ".incomplete are not listed in the manifest (left by an earlier convert" in err


def test_an_empty_state_folder_does_not_make_an_artifact_a_fetched_one(copy: Path) -> None:
    """Only the manifest fetch keeps makes a folder a fetched one that may lack ranks."""
    out = copy
    (out / ".shardprep").mkdir()
    first = read_manifest(out).files[0]
    (out / first.path).unlink()
    report = verify(out)
    assert not report.ok and not report.fetched
    assert any(first.path in problem for problem in report.problems), report.problems
