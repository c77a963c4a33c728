"""The manifest records the conversion request; `verify --full` replays exactly it (an
MTP draft left out with --no-mtp stays out, a draft is found from any folder, the
partition the environment gave is the one replayed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

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
