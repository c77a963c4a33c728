"""The manifest records the conversion request; `verify --full` replays exactly it (an
MTP draft left out with --no-mtp stays out, a draft is found from any folder, the
partition the environment gave is the one replayed)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import ConversionRequest, read_manifest


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("replay")
    return make_tiny_model(
        root / "v3", "DeepseekV3ForCausalLM", num_hidden_layers=3, num_nextn_predict_layers=1
    )


def test_verify_full_replays_no_mtp(mtp_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    manifest = convert(str(mtp_model), out, Options(tp=2, pp=1, mtp_draft=False), progress=False)
    assert manifest.model("draft") is None
    assert manifest.request == ConversionRequest(tp=2, pp=1, partition="3", mtp_draft=False)
    report = verify(out, full=True, progress=False)
    assert report.problems == [] and report.round_trip_tensors > 0
    assert main(["verify", str(out), "--full", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_an_artifact_without_a_recorded_request_is_replayed_from_its_effects(
    mtp_model: Path, tmp_path: Path
) -> None:
    """Artifacts made before the request was recorded: no draft model means none was
    converted, so the MTP layers stay out of the replay too."""
    out = tmp_path / "out"
    convert(str(mtp_model), out, Options(tp=2, pp=1, mtp_draft=False), progress=False)
    path = out / "shardprep.json"
    data = json.loads(path.read_text())
    del data["request"]
    path.write_text(json.dumps(data))
    assert read_manifest(out).request is None
    assert verify(out, full=True, progress=False).problems == []


def test_verify_full_replays_a_draft_and_the_partition_from_anywhere(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny.model("replay-llama", num_hidden_layers=4)
    draft = tiny.draft("replay-eagle3", model)
    monkeypatch.chdir(draft.parent)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    out = tmp_path / "out"
    manifest = convert(
        os.path.relpath(model), out, Options(tp=1, pp=2, draft=draft.name), progress=False
    )
    request = manifest.request
    assert request is not None
    assert (request.draft, request.draft_method, request.partition) == (str(draft), None, "3,1")
    assert manifest.topology.partition == (3, 1)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    monkeypatch.chdir(tmp_path)
    report = verify(out, full=True, progress=False)
    assert report.problems == [] and report.round_trip_tensors > 0


def tamper(out: Path, path: str) -> None:
    """Flip the last byte of a rank file (a weight, past the header) and re-hash it in
    the manifest, as someone who edits both would."""
    target = out / path
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    edit(out, lambda m: _rehash(m, path, hashlib.sha256(data).hexdigest()))


def _rehash(manifest: dict, path: str, digest: str) -> None:
    next(f for f in manifest["files"] if f["path"] == path)["sha256"] = digest


def edit(out: Path, change) -> None:
    path = out / "shardprep.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def one_line(out: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["verify", str(out), "--full", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.fixture(scope="module")
def staged(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tp2 x pp2 artifact with an EAGLE-3 draft, and its source."""
    model = tiny.model("replay-staged", num_hidden_layers=4)
    draft = tiny.draft("replay-staged-eagle3", model)
    out = tmp_path_factory.mktemp("staged") / "out"
    convert(str(model), out, Options(tp=2, pp=2, draft=str(draft)), progress=False)
    return out, draft


@pytest.fixture
def artifact(staged: tuple[Path, Path], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(staged[0], out)
    return out


def test_a_request_narrowed_to_one_stage_does_not_hide_the_other(artifact: Path, capsys) -> None:
    tamper(artifact, "shards/model-pp-0-tp-1-part-0.safetensors")
    found = one_line(artifact, capsys)  # the recorded request finds it, and says no rerun
    assert "model-pp-0-tp-1-part-0.safetensors: " in found and "convert into a new" in found
    edit(artifact, lambda m: m["request"].update(stage=1))
    assert verify(artifact).ok  # the hashes agree with the edited manifest
    assert one_line(artifact, capsys) == (
        f"shardprep: error: {artifact} failed verification with 1 problem(s): the request its "
        "manifest records disagrees with the artifact it lists (the request asks for stage 1, "
        "the manifest lists stages 0, 1). Its files match the manifest's sha256 but not the "
        "source: the manifest is not the one convert wrote, or the source changed since; "
        "convert into a new folder (a rerun here keeps files that match the manifest)\n"
    )


def test_a_request_without_the_draft_does_not_hide_it(
    artifact: Path, staged: tuple[Path, Path], capsys
) -> None:
    tamper(artifact, "draft/shards/model-pp-1-tp-0-part-0.safetensors")
    edit(artifact, lambda m: m["request"].update(draft=None, draft_method=None))
    assert f"(the request names no draft, the manifest lists the draft {staged[1]})" in one_line(
        artifact, capsys
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"tp": 1}, "the request asks for tp=1, the manifest lists tp=2"),
        ({"partition": "1,3"}, "the request asks for the partition 1,3, the manifest lists 2,2"),
        ({"draft": "/elsewhere"}, "the request names the draft /elsewhere, the manifest lists"),
        ({"expert_parallel": True}, "expert parallelism on, the manifest lists it off"),
        ({"dp": 2}, "the request asks for dp=2, the manifest lists no experts"),
        ({"mxfp4_pad": "64"}, "the MXFP4 padding 64, the manifest lists no MXFP4 experts"),
    ],
)
def test_a_request_that_disagrees_is_one_line_naming_both(
    artifact: Path, change: dict, expected: str, capsys
) -> None:
    edit(artifact, lambda m: m["request"].update(change))
    assert expected in one_line(artifact, capsys)


def test_a_replay_that_plans_another_artifact_is_one_line(artifact: Path, capsys) -> None:
    """What the request does not name but the plan shows: here another dtype."""
    edit(artifact, lambda m: m["request"].update(dtype="float32"))
    assert (
        "replaying the request its manifest records plans another artifact than the one it "
        "lists (the manifest: target dtype BF16, not F32" in one_line(artifact, capsys)
    )


def test_a_tensor_added_to_rank_files_and_manifest_is_found(artifact: Path, capsys) -> None:
    """Both tp ranks of stage 0 gain a tensor, the manifest lists it and their new sha256:
    hashes and coverage agree, the replay does not write it."""
    for tp in (0, 1):
        path = f"shards/model-pp-0-tp-{tp}-part-0.safetensors"
        tensors = load_file(artifact / path)
        tensors["model.layers.0.extra"] = torch.ones(4, dtype=torch.bfloat16)
        save_file(tensors, artifact / path, metadata={"format": "pt"})
        digest = hashlib.sha256((artifact / path).read_bytes()).hexdigest()

        def add(manifest: dict, path: str = path, digest: str = digest, tp: int = tp) -> None:
            entry = next(f for f in manifest["files"] if f["path"] == path)
            entry.update(sha256=digest, bytes=(artifact / path).stat().st_size)
            for model in manifest["models"]:  # as recorded before pieces were: none to list
                model["pieces"], model["source_shapes"] = {}, {}
            target = next(m for m in manifest["models"] if m["role"] == "target")
            target["ranks"][f"pp0-tp{tp}"]["model.layers.0.extra"] = {
                "dtype": "BF16",
                "shape": [4],
            }

        edit(artifact, add)
    assert verify(artifact).ok
    assert (
        "shards/model-pp-0-tp-0-part-0.safetensors: model.layers.0.extra, "
        "shards/model-pp-0-tp-1-part-0.safetensors: model.layers.0.extra are not replayed"
    ) in one_line(artifact, capsys)
