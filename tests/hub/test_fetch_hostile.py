"""`shardprep fetch` from a repo made by someone else (tests/support/hub_server.py, the real
huggingface_hub client), and `fetch --verify` on a cache whose bytes changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hostile import edit_manifest
from hub_server import HubServer
from huggingface_hub import HfApi, constants

from shardprep.cli import main
from shardprep.constants import MANIFEST_NAME
from shardprep.convert.run import Options, convert
from shardprep.hub.cache import STATE_DIR, repo_folder
from shardprep.hub.publish import publish

pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/Hostile-TP2-PP2"
SHARD = "shards/model-pp-1-tp-0-part-0.safetensors"


@pytest.fixture(scope="module")
def artifact(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "out"
    convert(str(tiny.model("llama")), out, Options(tp=2, pp=2), progress=False)
    return out


def fetch_cli(hub: HubServer, *args: str) -> tuple[int, str, str]:
    code = main(["fetch", REPO, "--endpoint", hub.endpoint, "-q", *args])
    return code, *_captured()


_capsys: pytest.CaptureFixture[str] | None = None


@pytest.fixture(autouse=True)
def _keep_capsys(capsys: pytest.CaptureFixture[str]) -> None:
    global _capsys
    _capsys = capsys


def _captured() -> tuple[str, str]:
    assert _capsys is not None
    out, err = _capsys.readouterr()
    return out, err


def upload_as_is(hub: HubServer, folder: Path) -> None:
    """What a stranger can push: any files, no `shardprep verify` on the way."""
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(REPO, exist_ok=True)
    api.upload_folder(repo_id=REPO, folder_path=folder)
    _captured()  # its progress bars


def test_a_manifest_naming_the_cache_state_is_refused(
    hub: HubServer, artifact: Path, tmp_path: Path
) -> None:
    """A repo whose extra file is a forged completion marker for stage 0 once made
    `fetch --stage 0` exit 0 with no stage-0 file."""
    crafted = Path(shutil.copytree(artifact, tmp_path / "crafted"))
    marker = crafted / STATE_DIR / "done" / "stage-0.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"stage": 0, "rank": None, "files": {}}))
    digest = hashlib.sha256(marker.read_bytes()).hexdigest()
    entry = {"path": f"{STATE_DIR}/done/stage-0.json", "bytes": marker.stat().st_size}
    edit_manifest(crafted, lambda d: d["extra_files"].append({**entry, "sha256": digest}))
    upload_as_is(hub, crafted)

    code, out, err = fetch_cli(hub, "--stage", "0")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("shardprep: error: ")
    assert "extra_files[2].path is '.shardprep/done/stage-0.json', not a config or" in err
    folder = repo_folder(REPO) / hub.head(REPO)
    assert not (folder / MANIFEST_NAME).exists()
    assert not (folder / STATE_DIR / "done").exists()
    assert not list(folder.rglob("*.safetensors"))


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (b"\xff\xfe\x00", "is not UTF-8 (byte 0)"),
        (b"[" * 100_000, "nests too deeply to be read"),
        (None, "manifest.files[0].bytes must be an integer"),
    ],
)
def test_a_malformed_manifest_is_one_line(
    hub: HubServer, artifact: Path, tmp_path: Path, manifest: bytes | None, message: str
) -> None:
    crafted = Path(shutil.copytree(artifact, tmp_path / "crafted"))
    if manifest is None:
        edit_manifest(crafted, lambda d: d["files"][0].update(bytes="428416"))
    else:
        (crafted / MANIFEST_NAME).write_bytes(manifest)
    upload_as_is(hub, crafted)
    code, out, err = fetch_cli(hub, "--stage", "1")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and message in err
    assert f"{REPO}@{hub.head(REPO)[:12]}/{MANIFEST_NAME}" in err


def test_fetch_verify_finds_and_repairs_a_flipped_byte(
    hub: HubServer,
    artifact: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    publish(artifact, REPO, endpoint=hub.endpoint, progress=False)
    _captured()
    code, out, _ = fetch_cli(hub, "--stage", "1")
    folder = Path(out.strip())
    assert code == 0 and folder == repo_folder(REPO) / hub.head(REPO)

    assert main(["verify", str(folder), "-q"]) == 0  # a one-stage folder verifies
    out, _ = _captured()
    assert out.startswith("ok (stage 1 of 0, 1; stage 0 not fetched here): 5 files")
    assert main(["publish", str(folder), "org/copy", "--endpoint", hub.endpoint, "-q"]) == 1
    _, err = _captured()
    assert "it is a fetched folder that holds stage 1 of 0, 1; stage 0 not fetched here" in err

    original = (folder / SHARD).read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    (folder / SHARD).write_bytes(bytes(flipped))

    assert fetch_cli(hub, "--stage", "1")[0] == 0  # a plain fetch trusts the cache
    assert (folder / SHARD).read_bytes() == bytes(flipped)
    assert main(["verify", str(folder), "-q"]) == 1
    _, err = _captured()
    assert f"{SHARD} does not match its sha256" in err and "`shardprep fetch --verify`" in err

    code, out, err = fetch_cli(hub, "--stage", "1", "--verify")
    assert code == 0 and Path(out.strip()) == folder
    assert f"{SHARD} in the cache does not match its sha256; it was removed" in caplog.text
    assert (folder / SHARD).read_bytes() == original
    assert hub.downloads(REPO, SHARD) == 2
    assert main(["verify", str(folder), "-q"]) == 0
    _captured()

    (folder / SHARD).write_bytes(bytes(flipped))  # offline, it can only say so
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, out, err = fetch_cli(hub, "--stage", "1", "--verify")
    assert code == 1 and out == ""
    assert err.count("\n") == 1, err
    assert f"{SHARD} of {REPO} in the cache ({folder}) did not match {MANIFEST_NAME}" in err
    assert not (folder / SHARD).exists()


def test_quiet_offline_verify_of_a_damaged_stage_is_one_line(
    hub: HubServer, artifact: Path
) -> None:
    """`fetch --verify --quiet` offline over a damaged cached file logs a warning (the file
    was removed) and then fails: with --quiet, stderr holds the error line only."""
    publish(artifact, REPO, endpoint=hub.endpoint, progress=False)
    code, out, _ = fetch_cli(hub, "--stage", "1")
    folder = Path(out.strip())
    assert code == 0
    flipped = bytearray((folder / SHARD).read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    (folder / SHARD).write_bytes(bytes(flipped))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "shardprep.cli", "fetch", REPO, "--stage", "1", "--verify", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("shardprep: error: ") and result.stderr.count("\n") == 1
    assert f"{SHARD} of {REPO} in the cache ({folder}) did not match" in result.stderr
