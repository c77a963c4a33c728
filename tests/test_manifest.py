from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from shardprep.convert import Options, convert
from shardprep.errors import ManifestError
from shardprep.manifest import Manifest, read_manifest

SCHEMA = json.loads((Path(__file__).parents[1] / "docs/manifest.schema.json").read_text())


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.tiny import make_tiny_draft, make_tiny_model

    root = tmp_path_factory.mktemp("manifest")
    model = make_tiny_model(root / "model")
    draft = make_tiny_draft(root / "draft-src", model)
    convert(str(model), root / "out", Options(tp=2, pp=2, draft=str(draft)), progress=False)
    return root / "out"


def test_emitted_manifest_matches_the_schema(artifact: Path) -> None:
    jsonschema.validate(json.loads((artifact / "shardprep.json").read_text()), SCHEMA)


def test_round_trip_through_json(artifact: Path) -> None:
    manifest = read_manifest(artifact)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert (
        manifest.rank_files("draft", 1, 0)[0].path
        == "draft/shards/model-pp-1-tp-0-part-0.safetensors"
    )


def _edited(artifact: Path, edit) -> str:
    data = json.loads((artifact / "shardprep.json").read_text())
    edit(data)
    return json.dumps(data)


def test_unknown_format_is_refused_with_the_version(artifact: Path) -> None:
    text = _edited(artifact, lambda d: d.update(format="shardprep/9"))
    with pytest.raises(
        ManifestError, match="has format 'shardprep/9'; this shardprep reads 'shardprep/1'"
    ):
        Manifest.from_json(text)


def test_unknown_key_is_refused(artifact: Path) -> None:
    text = _edited(artifact, lambda d: d["files"][0].update(compression="lz4"))
    with pytest.raises(ManifestError, match=r"unknown key\(s\) \['compression'\] in FileEntry"):
        Manifest.from_json(text)


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.safetensors", "shards/../../x"])
def test_paths_that_leave_the_artifact_are_refused(artifact: Path, path: str) -> None:
    text = _edited(artifact, lambda d: d["files"][0].update(path=path))
    with pytest.raises(ManifestError, match="which leaves the artifact"):
        Manifest.from_json(text)


def test_missing_manifest_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="has no shardprep.json.*shardprep convert MODEL -o"):
        read_manifest(tmp_path)
