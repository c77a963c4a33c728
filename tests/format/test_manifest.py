from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema import SCHEMA

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.errors import ManifestError
from shardprep.format.manifest import Manifest, parse_manifest, read_manifest, read_regions
from shardprep.loader.reader import read_rank


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.demo.tiny import make_tiny_draft, make_tiny_model

    root = tmp_path_factory.mktemp("manifest")
    model = make_tiny_model(root / "model")
    draft = make_tiny_draft(root / "draft-src", model)
    convert(str(model), root / "out", Options(tp=2, pp=2, draft=str(draft)), progress=False)
    return root / "out"


def test_emitted_manifest_matches_the_schema(artifact: Path) -> None:
    jsonschema.validate(json.loads((artifact / "shardprep.json").read_text()), SCHEMA)


def test_round_trip_through_json(artifact: Path) -> None:
    manifest = read_manifest(artifact)
    assert parse_manifest(manifest.to_json()) == manifest
    assert (
        manifest.rank_files("draft", 1, 0)[0].path
        == "draft/shards/model-pp-1-tp-0-part-0.safetensors"
    )


def _edited(artifact: Path, edit) -> str:
    """The manifest edited, its pieces inline as artifacts held them before the regions
    file (which is checked on its own in test_regions_file.py)."""
    data = json.loads(read_regions(artifact, read_manifest(artifact)).to_json())
    del data["regions"]
    edit(data)
    return json.dumps(data)


def test_unknown_format_is_refused_with_the_version(artifact: Path) -> None:
    text = _edited(artifact, lambda d: d.update(format="shardprep/9"))
    with pytest.raises(
        ManifestError, match="has format 'shardprep/9'; this shardprep reads 'shardprep/1'"
    ):
        parse_manifest(text)


def test_unknown_key_is_refused(artifact: Path) -> None:
    text = _edited(artifact, lambda d: d["files"][0].update(compression="lz4"))
    with pytest.raises(ManifestError, match=r"unknown key\(s\) \['compression'\] in FileEntry"):
        parse_manifest(text)


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.safetensors", "shards/../../x"])
def test_paths_that_leave_the_artifact_are_refused(artifact: Path, path: str) -> None:
    text = _edited(artifact, lambda d: d["files"][0].update(path=path))
    with pytest.raises(ManifestError, match="which leaves the artifact"):
        parse_manifest(text)


def test_missing_manifest_says_how_to_create_it(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="has no shardprep.json.*shardprep convert MODEL -o"):
        read_manifest(tmp_path)


# ---------------------------------------------------------------- hostile manifests

FUZZ = settings(
    max_examples=150,
    deadline=10_000,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
JUNK = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=6),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 3), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(
        [
            ".shardprep/done/stage-0.json",
            "../x",
            "shards/../../x",
            "draft",
            "",
            "pp0-tp9",
            "pp1-tp0",
            "zstd",
            "none",
            "F32",
            "target",
            "draft/config.json",
            "a" * 64,
            "0" * 64,
        ]
    ),
)


def _places(value: Any, path: tuple = ()) -> list[tuple]:
    """Every position in a JSON tree (the root excluded)."""
    places = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            places += _places(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            places += _places(item, (*path, i))
    return places


@st.composite
def near_valid_manifests(draw: st.DrawFn, text: str) -> bytes:
    data = json.loads(text)
    for _ in range(draw(st.integers(1, 2))):
        places = _places(data)
        *parents, last = draw(st.sampled_from(places))
        container = data
        for key in parents:
            container = container[key]
        kind = draw(st.sampled_from(["junk", "junk", "drop", "add", "nest", "copy"]))
        if kind == "junk":
            container[last] = draw(JUNK)
        elif kind == "drop":
            del container[last]
        elif kind == "add" and isinstance(container, dict):
            container[draw(st.text(max_size=5))] = draw(JUNK)
        elif kind == "nest":
            container[last] = [container[last]]
        elif kind == "copy" and isinstance(container, list):
            container.append(container[last])
    return json.dumps(data).encode()


def _accepts(raw: bytes) -> Manifest | None:
    tracemalloc.start()
    try:
        manifest = parse_manifest(raw)
    except ManifestError:
        manifest = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 * 1024**2 + 200 * len(raw)
    if manifest is not None:  # what this reader accepts, the published schema accepts too
        jsonschema.validate(json.loads(raw), SCHEMA)
        assert parse_manifest(manifest.to_json()) == manifest
    return manifest


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_give_a_manifest_or_a_manifest_error(raw: bytes) -> None:
    assert _accepts(raw) is None


@FUZZ
@given(data=st.data())
def test_near_valid_manifests_give_a_manifest_or_a_manifest_error(
    artifact: Path, data: st.DataObject
) -> None:
    _accepts(data.draw(near_valid_manifests((artifact / "shardprep.json").read_text())))


def test_the_untouched_manifest_is_accepted(artifact: Path) -> None:
    assert _accepts((artifact / "shardprep.json").read_bytes()) is not None


def _first(data: dict, role: str = "target") -> dict:
    return next(m for m in data["models"] if m["role"] == role)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["files"][0].update(bytes="428416"), "manifest.files[0].bytes must be an int"),
        (lambda d: d["files"][0].update(pp=True), "manifest.files[0].pp must be an integer"),
        (lambda d: d["topology"].update(tp=0), "manifest.topology.tp must be an integer from 1"),
        (lambda d: d.update(extra_files={}), "manifest.extra_files must be a list, found {}"),
        (lambda d: _first(d).update(ranks=[]), "manifest.models[0].ranks must be an object"),
        (
            lambda d: _first(d)["ranks"].update({"pp0-tpX": {}}),
            "ranks key 'pp0-tpX' must be a rank key like pp0-tp1",
        ),
        (lambda d: d["files"][0].update(sha256="ab"), "sha256 must be 64 lowercase hex digits"),
        (lambda d: d.update(files=[]), "need 4 ranks with files, but files lists 0"),
        (lambda d: d.update(stages=[]), "stages is empty"),
        (lambda d: d.update(stages=[0, 0]), "stages [0, 0] are not distinct stages of pp=2"),
        (lambda d: d["topology"].update(partition=[4]), "partition has 1 entries for pp=2"),
        (
            lambda d: d.update(files=[f for f in d["files"] if f["pp"] == 0 or f["tp"] == 1]),
            "stage 1 tp rank 0 has no target file",
        ),
        (
            lambda d: d.update(stages=[0]),
            "the target ranks differ from the topology's stages and tp at pp1-tp0, pp1-tp1",
        ),
        (
            lambda d: d["files"][0].update(path="shards/model-pp-1-tp-0-part-0.safetensors"),
            "is 'shards/model-pp-1-tp-0-part-0.safetensors', not 'shards/model-pp-0-tp-0-part-0",
        ),
        (
            lambda d: d["files"][0].update(path=".shardprep/done/stage-0.json"),
            "files[0].path is '.shardprep/done/stage-0.json', not 'shards/model-pp-0-tp-0",
        ),
        (
            lambda d: d["extra_files"][0].update(path=".shardprep/done/stage-0.json"),
            "not a config or tokenizer file of the model folder or draft/",
        ),
        (
            lambda d: d["extra_files"][0].update(path="shardprep.json"),
            "not a config or tokenizer file",
        ),
        (lambda d: _first(d).update(folder="x"), "the target folder is 'x', not ''"),
        (lambda d: d["files"][0].update(codec="zstd"), "has codec 'zstd' but stored_bytes"),
        (
            lambda d: d.update(models=[_first(d, "draft")]),
            "models has the roles ['draft']; one target and at most one draft",
        ),
        (
            lambda d: _first(d)["ranks"].update({"pp0-tp0": {}}),
            "the target rank(s) pp0-tp0 hold no parameter",
        ),
        (
            lambda d: _first(d)["pieces"].pop("model.norm.weight"),
            "the target parameter(s) model.norm.weight have no pieces",
        ),
        (
            lambda d: _first(d)["source_shapes"].pop("model.norm.weight"),
            "the target pieces name source(s) model.norm.weight of no recorded shape",
        ),
        (
            lambda d: _first(d)["pieces"].update(x=[["y", "diagonal"]]),
            "manifest.models[0].pieces['x'][0][1] must be one of 'replicate'",
        ),
        (
            lambda d: _first(d)["pieces"].update(x=[["y", "kv_heads"]]),
            "a kv_heads, parts_rows, qkv_rows, qkv_heads, align_rows or zero_rows piece, and "
            "only one, names",
        ),
        (
            lambda d: _first(d)["pieces"].update(x=[["y", "qkv_heads", {"heads": 2}]]),
            "pieces['x'][0]: a qkv_heads piece, and only one, names its q_heads",
        ),
        (
            lambda d: _first(d)["pieces"].update(x=[["y", "rows", {"q_heads": 2}]]),
            "pieces['x'][0]: a qkv_heads piece, and only one, names its q_heads",
        ),
        (
            lambda d: _first(d)["pieces"].update(x=[["y", "rows", {"expert": -1}]]),
            "pieces['x'][0][2].expert must be an integer from 0",
        ),
        (
            lambda d: _first(d)["pieces"].update(x=[["y", "rows", {"heads": 2, "z": 1}]]),
            "unknown key(s) ['z'] in PieceEntry",
        ),
        (lambda d: _first(d).update(pieces={"x": []}), "has an empty list of pieces"),
    ],
)
def test_each_flaw_is_named(artifact: Path, edit, message: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(_edited(artifact, edit))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff\xfe{}", "shardprep.json is not UTF-8 (byte 0)"),
        (b"[" * 100_000, "shardprep.json nests too deeply to be read"),
        (b'{"format": "shardprep/1", "format": "x"}', "names the key 'format' twice"),
        (b'{"format": NaN}', "holds NaN"),
    ],
)
def test_unreadable_json_is_named(raw: bytes, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(ManifestError, match=re.escape(message)):
        parse_manifest(raw)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["files"][0].update(bytes="1"), "files[0].bytes must be an integer"),
        (lambda d: _first(d).update(ranks=[]), "models[0].ranks must be an object"),
        (lambda d: d["topology"].update(tp=0), "topology.tp must be an integer from 1"),
    ],
)
def test_the_cli_says_which_field(
    artifact: Path, tmp_path: Path, capsys, command: str, edit, message: str
) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(artifact, folder)
    (folder / "shardprep.json").write_text(_edited(artifact, edit))
    assert main([command, str(folder)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and message in err
    assert err.count("\n") == 1


def test_a_huge_topology_is_refused_before_any_rank_is_walked(artifact: Path) -> None:
    def huge(data: dict) -> None:
        data["topology"].update(tp=65536, pp=65536, partition=[1] * 65536)
        data["stages"] = list(range(65536))

    started = time.monotonic()
    with pytest.raises(ManifestError, match="need 4,294,967,296 ranks with files, but files"):
        parse_manifest(_edited(artifact, huge))
    assert time.monotonic() - started < 2


def test_the_loader_refuses_a_bad_manifest(artifact: Path, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(artifact, folder)
    (folder / "shardprep.json").write_bytes(b"\xc3\x28")
    with pytest.raises(ManifestError, match="is not UTF-8"):
        list(read_rank(folder, "target", 0, 0))


def test_a_failed_write_leaves_no_temporary_file(artifact: Path, tmp_path: Path) -> None:
    """A real write failure: a 1 kB file-size limit (SIGXFSZ ignored, so write raises)."""
    folder = tmp_path / "out"
    folder.mkdir()
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from shardprep.format.manifest import read_manifest, write_manifest\n"
        "manifest = read_manifest(Path(sys.argv[1]))\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "try:\n"
        "    write_manifest(Path(sys.argv[2]), manifest)\n"
        "except OSError as exc:\n"
        "    print(exc.errno)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(artifact), str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == str(errno.EFBIG), result.stderr
    assert list(folder.iterdir()) == []
