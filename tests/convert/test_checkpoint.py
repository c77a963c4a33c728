"""Reading a source checkpoint: the index and the headers, whatever their bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hostile import rewrite_header
from hypothesis import given, settings
from hypothesis import strategies as st

from shardprep.cli import main
from shardprep.convert.checkpoint import INDEX_NAME, parse_index
from shardprep.demo.tiny import make_tiny_model
from shardprep.errors import ConfigError

FUZZ = settings(max_examples=150, deadline=10_000, database=None)

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
FILE_NAMES = st.one_of(
    st.sampled_from(
        [
            "model-00001-of-00002.safetensors",
            "../x.safetensors",
            "/abs.safetensors",
            "a\\b.safetensors",
            "config.json",
            "",
            "sub/m.safetensors",
            "n\x00.safetensors",
        ]
    ),
    st.text(max_size=12),
    JSON_VALUES,
)


@st.composite
def near_valid_indexes(draw: st.DrawFn) -> bytes:
    weight_map = draw(st.dictionaries(st.text(max_size=8), FILE_NAMES, max_size=4))
    document: Any = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    if draw(st.booleans()):
        document = draw(
            st.sampled_from([[document], {"weight_map": draw(JSON_VALUES)}, weight_map])
        )
    return json.dumps(document).encode()


def check_index(raw: bytes) -> None:
    try:
        weight_map = parse_index(raw, "index")
    except ConfigError:
        return
    for name, file in weight_map.items():
        assert isinstance(name, str) and isinstance(file, str)
        assert file.endswith(".safetensors") and ".." not in Path(file).parts
        assert not Path(file).is_absolute() and "\x00" not in file and "\\" not in file


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_give_a_weight_map_or_a_config_error(raw: bytes) -> None:
    check_index(raw)


@FUZZ
@given(near_valid_indexes())
def test_near_valid_indexes_give_a_weight_map_or_a_config_error(raw: bytes) -> None:
    check_index(raw)


def _copy(tiny: Any, tmp_path: Path, files: int = 1) -> Path:
    model = tiny.model("llama-2files" if files == 2 else "llama", files=files)
    return Path(shutil.copytree(model, tmp_path / "model"))


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (b"\xff\xfe", f"{INDEX_NAME} is not UTF-8 (byte 0); it is not a safetensors index"),
        (b"[" * 50_000, "nests too deeply"),
        (b'{"weight_map": ["model.safetensors"]}', "has no weight_map object"),
        (b'{"weight_map": {"w": 3}}', "maps 'w' to 3, not to a file name"),
        (b'{"weight_map": {"w": "../../etc/x.safetensors"}}', "not a *.safetensors file inside"),
        (b'{"weight_map": {"w": "config.json"}}', "not a *.safetensors file inside"),
    ],
)
def test_a_hostile_index_is_one_line_from_plan(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], index: bytes, message: str
) -> None:
    model = _copy(tiny, tmp_path, files=2)
    (model / INDEX_NAME).write_bytes(index)
    assert main(["plan", str(model)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("kind", [float, str])
def test_float_or_string_offsets_are_one_line_from_convert(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: type
) -> None:
    model = _copy(tiny, tmp_path)

    def edit(header: dict[str, Any]) -> None:
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [kind(v) for v in header[name]["data_offsets"]]

    rewrite_header(model / "model.safetensors", edit)
    out = tmp_path / "out"
    assert main(["convert", str(model), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ")
    assert "data_offsets that are not two integers >= 0 [begin, end]" in err
    assert err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (b"\xff\xfe{}", "config.json is not UTF-8 (byte 0)"),
        (b"[" * 50_000, "config.json nests too deeply"),
        (b'{"hidden_size": NaN}', "config.json holds NaN"),
        (b"[]", "config.json does not hold a JSON object"),
    ],
)
def test_an_unreadable_config_is_one_line(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], config: bytes, message: str
) -> None:
    model = _copy(tiny, tmp_path)
    (model / "config.json").write_bytes(config)
    assert main(["plan", str(model)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("command", ["plan", "convert"])
def test_a_source_folder_named_in_no_utf8_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A folder whose name is Latin-1 bytes (not UTF-8): the manifest could not record it
    (every reader would refuse it), so plan and convert refuse it in one line at once."""
    model = Path(os.fsdecode(os.fsencode(tmp_path) + b"/mod\xe8le"))
    make_tiny_model(model, num_hidden_layers=2)
    out = tmp_path / "out"
    extra = ["-o", str(out)] if command == "convert" else []
    assert main([command, str(model), *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardprep: error: the source folder ")
    assert "mod\\xe8le has a name that is not valid UTF-8" in err
    assert not out.exists()


def test_a_copied_file_named_in_no_utf8_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=2)
    Path(os.fsdecode(os.fsencode(model) + b"/tokenizer-\xff.json")).write_text("{}")
    assert main(["convert", str(model), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "the source file " in err and "tokenizer-\\xff.json has a name" in err
    assert not (tmp_path / "out").exists()
