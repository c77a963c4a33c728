"""Strings that reach the terminal or an artifact from files: a manifest's escape codes are
printed visible, and a copied file whose name an artifact cannot hold is refused before
anything is written, not by shardprep's own reader afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hostile import edit_manifest
from hub_server import HubServer
from huggingface_hub import HfApi

from shardprep.cli import main

ESCAPES = "evil\x1b[2J\x1b]0;title\x07\x9b31m"


def test_inspect_prints_a_manifests_escape_codes_visible(tiny, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(tiny.model("llama")), "-o", str(out), "--quiet"]) == 0
    edit_manifest(out, lambda data: data["models"][0]["source"].update(model=ESCAPES))
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "from evil\\x1b[2J\\x1b]0;title\\x07\\x9b31m" in text
    assert not any(ch in text for ch in "\x1b\x07\x9b")
    assert main(["inspect", str(out), "--json"]) == 0
    data = capsys.readouterr().out
    assert not any(ch in data for ch in "\x1b\x07\x9b")
    assert json.loads(data)["models"][0]["source"] == ESCAPES


NAMES = ["tokenizer\x1b[31m.json", "tokenizer\n.json", "tokenizer.json.tmp"]


@pytest.mark.parametrize("name", NAMES)
def test_a_copied_file_the_artifact_cannot_hold_is_refused_up_front(
    tiny, tmp_path: Path, capsys, name: str
) -> None:
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny.model("llama"), model)
    (model / name).write_text("{}")
    assert main(["convert", str(model), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: the source file ") and err.count("\n") == 1, err
    assert "has a name that an artifact cannot hold" in err and "\x1b" not in err
    assert not out.exists()


@pytest.mark.usefixtures("hf_client_env")
@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # the client's PUT
def test_a_hub_repos_file_the_artifact_cannot_hold_is_refused_up_front(
    tiny, hub: HubServer, tmp_path: Path, capsys
) -> None:
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo("org/names")
    api.upload_folder(repo_id="org/names", folder_path=tiny.model("llama"))
    api.upload_file(repo_id="org/names", path_or_fileobj=b"{}", path_in_repo=NAMES[0])
    out = tmp_path / "out"
    capsys.readouterr()  # the uploads' bars
    for command in (["plan"], ["convert", "-o", str(out)]):
        assert main([*command[:1], "org/names", *command[1:], "--endpoint", hub.endpoint]) == 1
        err = capsys.readouterr().err
        assert err.startswith("shardprep: error: the source file tokenizer\\x1b[31m.json in ")
        assert err.count("\n") == 1 and "org/names has a name that an artifact" in err
    assert not out.exists()


def test_a_copied_file_linked_outside_the_model_is_refused(tiny, tmp_path: Path, capsys) -> None:
    model, out, secret = tmp_path / "model", tmp_path / "out", tmp_path / "secret.txt"
    shutil.copytree(tiny.model("llama"), model)
    secret.write_text("not for publishing")
    (model / "tokenizer.json").unlink(missing_ok=True)
    (model / "tokenizer.json").symlink_to(secret)
    assert main(["convert", str(model), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"tokenizer.json is a link to {secret}, outside" in err
    assert not out.exists()


def test_a_link_into_a_hugging_face_cache_blob_is_copied(tiny, tmp_path: Path) -> None:
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(tiny.model("llama"), model)
    blob = tmp_path / "hub" / "models--org--tiny" / "blobs" / "0123abcd"
    blob.parent.mkdir(parents=True)
    blob.write_text('{"version": "1.0"}')
    (model / "tokenizer.json").unlink(missing_ok=True)
    (model / "tokenizer.json").symlink_to(blob)
    assert main(["convert", str(model), "-o", str(out), "--quiet"]) == 0
    copied = out / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"version": "1.0"}'
