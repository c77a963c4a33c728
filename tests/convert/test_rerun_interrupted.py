"""A rerun over a complete artifact that fails (a file size limit: EFBIG) or is stopped
(SIGTERM) leaves its journal beside the manifest; a convert of another model into that
folder is still refused in one line, and the artifact stays as it was."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_server import HubServer
from huggingface_hub import HfApi

from shardprep.constants import MANIFEST_NAME, PARTIAL_MARKER
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_model
from shardprep.errors import OutputExistsError

pytestmark = [
    pytest.mark.slow,  # each runs a convert in a child process
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/rerun"
WEIGHTS = "model.safetensors"


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardprep.cli", *args]


def refuses_another_model(out: Path, other: Path, expected: str) -> None:
    """A convert of `other` into `out` is refused and changes nothing there."""
    before = snapshot(out)
    with pytest.raises(OutputExistsError) as info:
        convert(str(other), out, Options(tp=2, pp=1), progress=False)
    assert str(info.value) == (
        f"{out} holds a shardprep artifact of another model or topology (target source "
        f"{expected}); choose a new output folder or delete that one"
    )
    assert snapshot(out) == before


def test_a_rerun_cut_by_a_file_size_limit_keeps_the_refusal(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=1)
    b = make_tiny_model(tmp_path / "b", seed=2)
    out = tmp_path / "out"
    convert(str(a), out, Options(tp=2, pp=1), progress=False)
    rank = out / "shards" / "model-pp-0-tp-0-part-0.safetensors"
    size = rank.stat().st_size
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF  # the rerun writes this file again, and the limit stops it
    rank.write_bytes(bytes(data))
    limit = size // 2
    assert limit > 4096  # room for the journal, not for the rank file

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        cli("convert", str(a), "-o", str(out), "--tp", "2", "--quiet"),
        capture_output=True,
        timeout=300,
        preexec_fn=limited,
        check=False,
    )
    err = result.stderr.decode()
    assert result.returncode == 1 and err.count("\n") == 1, err
    assert "File too large" in err and "lower --max-part-size or raise the limit" in err
    assert (out / PARTIAL_MARKER).is_file() and (out / MANIFEST_NAME).is_file()
    refuses_another_model(out, b, str(a.resolve()))
    convert(str(a), out, Options(tp=2, pp=1), progress=False)  # the same plan: repaired
    assert not (out / PARTIAL_MARKER).exists()
    assert verify(out, full=True).ok


def test_a_rerun_stopped_by_sigterm_keeps_the_refusal(
    hub: HubServer, hf_client_env: Path, tmp_path: Path
) -> None:
    """The rerun downloads its source again (not in the cache any more) and the server
    stalls halfway: SIGTERM arrives while the rerun's journal is on disk."""
    model = make_tiny_model(tmp_path / "model", seed=1)
    other = make_tiny_model(tmp_path / "other", seed=2)
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=model)
    out = tmp_path / "out"
    convert(REPO, out, Options(tp=2, pp=1, endpoint=hub.endpoint), progress=False)
    storage = hf_client_env / "hub" / f"models--{REPO.replace('/', '--')}"
    for path in (*storage.glob("snapshots/*/" + WEIGHTS), *storage.glob("blobs/*")):
        if path.is_symlink() or path.stat().st_size > 4096:  # the weights, not config.json
            path.unlink()
    cut = (model / WEIGHTS).stat().st_size // 2
    stall = hub.stall_next_download(REPO, WEIGHTS, cut)
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    command = cli("convert", REPO, "-o", str(out), "--tp", "2", "--quiet")
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while not (
            (out / PARTIAL_MARKER).is_file()
            and any(p.stat().st_size == cut for p in storage.glob("blobs/*.incomplete"))
        ):
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline, "the rerun never reached the stall"
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        stall.set()
    assert process.returncode != 0, err.decode()
    assert (out / PARTIAL_MARKER).is_file() and (out / MANIFEST_NAME).is_file()
    refuses_another_model(out, other, REPO)
