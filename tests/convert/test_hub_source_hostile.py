"""A Hub source served by a hostile Hub (tests/support/hub_server.py's hostile answers):
the bytes converted are the bytes checked, whatever the server answers the second time or
to a range read; no write follows a link planted in the Hugging Face cache; a revision
that is not a branch, tag or commit name never reaches the cache as a path; and `--quiet`
stays one line while the client retries. The model and repo are those of
test_hub_source (tests/support/hub_stages.py)."""

from __future__ import annotations

import hashlib
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import hub_stages
import pytest
from hostile import edit_manifest, split
from hub_server import HubServer
from hub_stages import (
    REPO,
    SECOND,
    WEIGHTS,
    body_ranges,
    files_fetched,
    hub_options,
    sha256_of,
    stage_shards,
)
from huggingface_hub import try_to_load_from_cache

from shardprep.constants import MANIFEST_NAME
from shardprep.convert.hub_source import fetch
from shardprep.convert.run import Options, convert, load_and_plan
from shardprep.errors import ConfigError, HubError, ManifestError, OutputExistsError
from shardprep.format.manifest import read_manifest

model, repo = hub_stages.model, hub_stages.repo  # the fixtures of these tests
pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def _storage(hf_client_env: Path) -> Path:
    return hf_client_env / "hub" / f"models--{REPO.replace('/', '--')}"


def _local_stage1(model: Path, tmp_path: Path) -> dict[str, bytes]:
    full = tmp_path / "local"
    convert(str(model), full, Options(tp=2, pp=2, stage=1), progress=False)
    shards = stage_shards(full, 1)
    assert shards
    return shards


def _other_weights(data: bytes) -> bytes:
    """The same header, other tensor bytes (the last one flipped): a file that converts."""
    other = bytearray(data)
    other[-1] ^= 0xFF
    return bytes(other)


def _cli(hub: HubServer, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    return subprocess.run(
        [sys.executable, "-m", "shardprep.cli", *args],
        capture_output=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_a_second_answer_never_reaches_the_snapshot(
    hub: HubServer, repo: str, model: Path, tmp_path: Path, hf_client_env: Path
) -> None:
    """After the first download of SECOND the server names and sends other bytes: the
    snapshot links the blob that was checked, and nothing asks the server again. A
    snapshot link found pointing at another blob (as a client that asked again left it)
    is replaced by the checked blob's before the file is read."""
    real = (model / SECOND).read_bytes()
    other = _other_weights(real)
    hub.serve_other_after_download(REPO, SECOND, other)
    local = _local_stage1(model, tmp_path)
    convert(REPO, tmp_path / "out", hub_options(hub, stage=1), progress=False)
    assert stage_shards(tmp_path / "out", 1) == local
    blobs = _storage(hf_client_env) / "blobs"
    link = _storage(hf_client_env) / "snapshots" / repo / SECOND
    assert os.readlink(link) == f"../../blobs/{sha256_of(model / SECOND)}"
    assert Path(str(try_to_load_from_cache(REPO, SECOND, revision=repo))).read_bytes() == real
    assert ("HEAD", f"/{REPO}/resolve/{repo}/{SECOND}") not in hub.requests
    assert body_ranges(hub, SECOND) == [None]
    # The cache as a client that asked again leaves it: the snapshot names the other body.
    wrong = hashlib.sha256(other).hexdigest()
    (blobs / wrong).write_bytes(other)
    link.unlink()
    link.symlink_to(f"../../blobs/{wrong}")
    convert(REPO, tmp_path / "again", hub_options(hub, stage=1), progress=False)
    assert stage_shards(tmp_path / "again", 1) == local
    assert os.readlink(link) == f"../../blobs/{sha256_of(model / SECOND)}"
    assert body_ranges(hub, SECOND) == [None]  # the checked blob was there: not fetched again


def _swap_names(data: bytes, first: bytes, second: bytes) -> bytes:
    """The file with two tensors' names exchanged in its header (names of one length, so
    the header keeps its length): each name then points at the other's bytes."""
    assert len(first) == len(second)
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + length]
    swapped = header.replace(first, b"\0" * len(first)).replace(second, first)
    swapped = swapped.replace(b"\0" * len(first), second)
    assert swapped != header and len(swapped) == len(header)
    return data[:8] + swapped + data[8 + length :]


@pytest.mark.parametrize("budget", [False, True], ids=["cache", "source-budget"])
def test_a_header_read_other_than_the_file_is_refused(
    hub: HubServer, repo: str, model: Path, tmp_path: Path, budget: bool
) -> None:
    real = (model / SECOND).read_bytes()
    names = (b'"model.layers.2.mlp.down_proj.weight"', b'"model.layers.3.mlp.down_proj.weight"')
    hostile = _swap_names(real, *names)
    assert split(hostile)[0] != split(real)[0]
    hub.answer_header_reads_with(REPO, SECOND, hostile)
    out = tmp_path / "out"
    more = {"source_budget": 2 * len(real)} if budget else {}
    with pytest.raises(HubError) as refused:
        convert(REPO, out, hub_options(hub, stage=1, **more), progress=False)
    message = str(refused.value)
    assert "\n" not in message and SECOND in message and "another header" in message, message
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("shards/*"))
    assert body_ranges(hub, SECOND) == [None]  # downloaded (and checked), then refused


def test_a_link_planted_at_the_partial_download_is_not_followed(
    hub: HubServer, repo: str, model: Path, tmp_path: Path, hf_client_env: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    blobs = _storage(hf_client_env) / "blobs"
    blobs.mkdir(parents=True)
    partial = blobs / f"{sha256_of(model / SECOND)}.incomplete"
    partial.symlink_to(victim)
    convert(REPO, tmp_path / "out", hub_options(hub, stage=1), progress=False)
    assert victim.read_bytes() == b"precious"
    assert not partial.exists() and not partial.is_symlink()
    assert (blobs / sha256_of(model / SECOND)).read_bytes() == (model / SECOND).read_bytes()
    assert body_ranges(hub, SECOND) == [None]  # nothing of the link's target counted as kept
    assert stage_shards(tmp_path / "out", 1) == _local_stage1(model, tmp_path)


@pytest.mark.parametrize("revision", ["../../outside", "/etc/x", "a\\b", "main\x1b[2J", "a..b"])
def test_a_revision_that_is_not_a_ref_name_is_refused(
    hub: HubServer, repo: str, revision: str
) -> None:
    asked = len(hub.requests)
    with pytest.raises(ConfigError, match="not a branch, tag or commit name") as refused:
        load_and_plan(REPO, hub_options(hub, revision=revision))
    assert "\n" not in str(refused.value) and "\x1b" not in str(refused.value)
    assert len(hub.requests) == asked


def test_a_revision_flag_that_is_not_a_ref_name_is_one_line(
    hub: HubServer, repo: str, tmp_path: Path
) -> None:
    asked = len(hub.requests)
    out = tmp_path / "out"
    for command in (
        ["convert", REPO, "--tp", "2", "--pp", "2", "-o", str(out)],
        ["plan", REPO, "--tp", "2", "--pp", "2"],
        ["fetch", REPO, "--stage", "0"],
    ):
        result = _cli(hub, *command, "--revision", "../../outside", "--quiet")
        lines = result.stderr.decode().splitlines()
        assert result.returncode == 1 and len(lines) == 1, (command, lines)
        assert "--revision" in lines[0] and "not a branch, tag or commit name" in lines[0]
        assert result.stdout == b""
    assert len(hub.requests) == asked and not out.exists()


def test_a_manifest_revision_that_is_not_a_ref_name_is_refused(
    hub: HubServer, model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=2), progress=False)
    edit_manifest(out, lambda data: data["request"].update(revision="../../../../x"))
    with pytest.raises(ManifestError, match="request.revision must be a branch, tag or commit"):
        read_manifest(out)
    result = _cli(hub, "verify", str(out), "--full", "--quiet")
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "request.revision" in lines[0], lines
    assert hub.requests == []


@pytest.mark.slow
def test_quiet_is_one_line_when_the_client_retries(
    hub: HubServer, repo: str, tmp_path: Path
) -> None:
    """config.json answers 503 to every request: huggingface_hub retries five times,
    logging each, then fails; under --quiet the terminal shows only shardprep's line."""
    hub.fail_requests(REPO, "config.json", 503)
    result = _cli(hub, "plan", REPO, "--tp", "2", "--pp", "2", "--quiet")
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("shardprep: error: ") and "503" in lines[0], lines
    heads = [r for r in hub.requests if r == ("HEAD", f"/{REPO}/resolve/main/config.json")]
    assert len(heads) > 3, hub.requests  # the client did retry
    assert result.stdout == b""


def test_partial_downloads_no_file_of_the_commit_resumes_are_deleted(
    hub: HubServer, repo: str, model: Path, tmp_path: Path, hf_client_env: Path
) -> None:
    """Partial downloads of another commit go when a convert starts, except one another
    process is writing (it holds the blob's lock) and huggingface_hub's own temporary
    files; this commit's partial download is resumed."""
    from filelock import FileLock

    storage = _storage(hf_client_env)
    blobs = storage / "blobs"
    blobs.mkdir(parents=True)
    stale, busy = (hashlib.sha256(b"%d" % n).hexdigest() for n in (1, 2))
    for sha in (stale, busy):
        (blobs / f"{sha}.incomplete").write_bytes(b"x" * 1000)
    client_own = blobs / f"{stale}.0123abcd.incomplete"
    client_own.write_bytes(b"y")
    real = (model / SECOND).read_bytes()
    half = len(real) // 2
    (blobs / f"{sha256_of(model / SECOND)}.incomplete").write_bytes(real[:half])
    lock = hf_client_env / "hub" / ".locks" / storage.name / f"{busy}.lock"
    lock.parent.mkdir(parents=True)
    with FileLock(lock):
        convert(REPO, tmp_path / "out", hub_options(hub, stage=1), progress=False)
    assert not (blobs / f"{stale}.incomplete").exists()
    assert (blobs / f"{busy}.incomplete").exists() and client_own.exists()
    assert body_ranges(hub, SECOND) == [f"bytes={half}-"]
    assert (blobs / sha256_of(model / SECOND)).read_bytes() == real


def test_a_foreign_folder_is_refused_before_anything_is_downloaded(
    hub: HubServer, repo: str, tmp_path: Path
) -> None:
    for name, files in {
        "with-notes": ["notes.txt", ".source-download/mine.txt"],
        "only-source-download": [".source-download/mine.txt"],
    }.items():
        out = tmp_path / name
        for file in files:
            (out / file).parent.mkdir(parents=True, exist_ok=True)
            (out / file).write_text("the user's")
        for budget in (None, 10**7):
            options = hub_options(hub, source_budget=budget)
            with pytest.raises(OutputExistsError, match="not a shardprep artifact"):
                convert(REPO, out, options, progress=False)
            assert all((out / file).read_text() == "the user's" for file in files)
            assert sorted(p.name for p in out.iterdir()) == sorted(
                {file.split("/")[0] for file in files}
            )
    assert not files_fetched(hub, REPO, WEIGHTS)


def test_a_full_cache_is_named_as_the_cache(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    """A file-size limit that the rank files fit in but SECOND does not: the download
    into the Hugging Face cache fails, and the line names the cache, not the output."""
    limit = 500_000
    assert (
        (model / SECOND).stat().st_size
        > limit
        > max(len(data) for data in _local_stage1(model, tmp_path).values())
    )
    out = tmp_path / "out"
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    command = [sys.executable, "-m", "shardprep.cli", "convert", REPO, "--tp", "2", "--pp", "2"]
    result = subprocess.run(
        [*command, "--stage", "1", "-o", str(out), "--quiet"],
        capture_output=True,
        timeout=300,
        env=env,
        check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1 and len(lines) == 1, lines
    assert "Hugging Face cache" in lines[0] and "File too large" in lines[0], lines
    assert f"convert to {out}" not in lines[0]
    assert not (out / MANIFEST_NAME).exists()


def test_a_tensor_read_before_its_file_arrived_is_checked_on_arrival(
    hub: HubServer, repo: str, model: Path
) -> None:
    """What the plan reads of a tensor by range request (a draft's copy compared with the
    target's, a weight vLLM dequantizes) must be what the downloaded file holds there."""
    real = (model / SECOND).read_bytes()
    header, _ = split(real)
    name = "model.layers.2.mlp.down_proj.weight"
    start, end = header[name]["data_offsets"]
    offset = len(real) - len(split(real)[1]) + start
    other = bytearray(real)
    other[offset] ^= 0xFF
    hub.answer_header_reads_with(REPO, SECOND, bytes(other))  # the header reads stay honest
    _, checkpoints = load_and_plan(REPO, hub_options(hub, stage=1))
    target = checkpoints["target"]
    assert target.read(SECOND, offset, end - start) == bytes(other[offset : offset + end - start])
    with pytest.raises(HubError) as refused:
        fetch(target, [SECOND])
    message = str(refused.value)
    assert "\n" not in message and f"other bytes at {offset:,}" in message, message
