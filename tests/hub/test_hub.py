"""Publish and fetch through the test Hub (support/hub_server.py) with the real huggingface_hub
client: one stage per node, a lock per stage, verified bytes, zstd transport, offline use.

huggingface_hub reads HF_HUB_DISABLE_XET, HF_HUB_OFFLINE and HF_HOME at import, so the
autouse fixture patches `huggingface_hub.constants` for this process and the environment for
subprocesses; the endpoint goes through `endpoint=` (see tests/hub/test_hub_server.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from codec_bombs import bomb
from filelock import FileLock
from hub_server import HubServer
from huggingface_hub import HfApi, ModelCard, constants, hf_hub_download

from shardprep import cli
from shardprep.constants import MANIFEST_NAME
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.errors import ConfigError, CorruptFileError, HubError, TopologyMismatchError
from shardprep.format.manifest import Manifest, Source, read_manifest, write_manifest
from shardprep.hub.cache import STATE_DIR, ensure_stage, fetch, repo_folder
from shardprep.hub.cache_parts import worker_parts
from shardprep.hub.cache_state import Part
from shardprep.hub.modelcard import model_card
from shardprep.hub.publish import publish

# The client's own LFS PUT passes a file object as `data=`, which httpx2 deprecates.
pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/Tiny-TP2-PP2"


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and its EAGLE3 draft at tp2 x pp2 (the draft on stage 1 only)."""
    model = tiny.model("llama")
    draft = tiny.draft("eagle3", model)
    out = tmp_path_factory.mktemp("hub") / "tiny-tp2-pp2"
    convert(str(model), out, Options(tp=2, pp=2, draft=str(draft)), progress=False)
    return out


@pytest.fixture
def published(hub: HubServer, artifact: Path) -> str:
    return publish(artifact, REPO, endpoint=hub.endpoint, progress=False)


def _manifest(artifact: Path) -> Manifest:
    return read_manifest(artifact)


def _stage_paths(artifact: Path, stage: int) -> list[str]:
    return [f.path for f in _manifest(artifact).files if f.pp == stage]


def _wanted_paths(artifact: Path, stage: int) -> list[str]:
    extras = [e.path for e in _manifest(artifact).side_files]
    return _stage_paths(artifact, stage) + extras


def _requested(hub: HubServer) -> list[str]:
    """Repo paths of every HEAD or GET of /resolve/ so far."""
    return [
        path.split("/resolve/", 1)[1].split("/", 1)[1]
        for method, path in hub.requests
        if "/resolve/" in path
    ]


def _files_under(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_one_stage_holds_no_byte_of_the_other(
    hub: HubServer, artifact: Path, published: str, hf_client_env: Path
) -> None:
    folder = fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)

    assert folder == repo_folder(REPO) / published
    for path in _wanted_paths(artifact, 1):
        assert (folder / path).read_bytes() == (artifact / path).read_bytes(), path
    assert (folder / MANIFEST_NAME).read_bytes() == (artifact / MANIFEST_NAME).read_bytes()
    assert (folder / "draft/config.json").is_file()  # the draft lives on the last stage

    stage0 = _stage_paths(artifact, 0)
    stage0_hashes = {_sha256(artifact / path) for path in stage0}
    cached = _files_under(repo_folder(REPO), hf_client_env)
    assert not any("model-pp-0-" in str(path) for path in cached)
    assert not stage0_hashes & {_sha256(path) for path in cached}
    assert not set(stage0) & set(_requested(hub))  # not even a HEAD
    assert {Path(p).name for p in _requested(hub)} >= {MANIFEST_NAME}
    assert not (folder / STATE_DIR / "staging" / "stage-1").exists()

    before = len(hub.requests)
    assert fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False) == folder
    assert [path for _, path in hub.requests[before:]] == [f"/api/models/{REPO}/revision/main"]


def test_fetch_one_rank_only(hub: HubServer, artifact: Path, published: str) -> None:
    folder = fetch(REPO, stage=1, rank=0, endpoint=hub.endpoint, progress=False)
    rank_files = [f.path for f in _manifest(artifact).files if (f.pp, f.tp) == (1, 0)]
    other = [f.path for f in _manifest(artifact).files if (f.pp, f.tp) != (1, 0)]
    assert all((folder / path).is_file() for path in rank_files)
    assert not any((folder / path).exists() for path in other)
    assert not set(other) & set(_requested(hub))

    fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)  # the rest of the stage
    assert all(hub.downloads(REPO, path) == 1 for path in _wanted_paths(artifact, 1))


def test_fetch_a_stage_of_another_pipeline_split(
    hub: HubServer, artifact: Path, published: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 layers at pp2 are (2, 2); at pp4 stage 1 holds layer 1 (artifact stage 0 only),
    at pp3 (1, 2, 1) stage 1 holds layers 1-2 (artifact stages 0 and 1)."""
    assert _manifest(artifact).topology.partition == (2, 2)
    argv = ["fetch", REPO, "--stage", "1", "--pp", "4", "--endpoint", hub.endpoint]
    assert cli.main([*argv, "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    folder = Path(out["path"])
    assert (out["stage"], out["pp"]) == (1, 4)
    assert set(_requested(hub)) == {*_wanted_paths(artifact, 0), MANIFEST_NAME}
    assert all(
        (folder / p).read_bytes() == (artifact / p).read_bytes() for p in _stage_paths(artifact, 0)
    )
    assert not any((folder / p).exists() for p in _stage_paths(artifact, 1))

    before = len(_requested(hub))
    assert fetch(REPO, stage=1, pp=3, endpoint=hub.endpoint, progress=False) == folder
    assert set(_requested(hub)[before:]) == set(_stage_paths(artifact, 1))  # stage 0 is cached
    assert all(hub.downloads(REPO, path) == 1 for path in _stage_paths(artifact, 1))
    assert (folder / "draft/config.json").is_file()

    with pytest.raises(ConfigError, match="--pp 3 needs --stage"):
        fetch(REPO, pp=3, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="stage 3 is not one of the 3 stages"):
        fetch(REPO, stage=3, pp=3, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="holds stage\\(s\\) 0, 1 of pp=2, not stage 2"):
        fetch(REPO, stage=2, pp=2, endpoint=hub.endpoint)  # its own split: its own stages
    with pytest.raises(ConfigError, match="fewer than pp=5 stages"):
        fetch(REPO, stage=0, pp=5, endpoint=hub.endpoint)


def test_fetch_a_rank_of_a_coarser_tp(
    hub: HubServer, tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 of tp2 from a tp4 x pp2 artifact is its ranks 2 and 3; with --pp 1 as well,
    those ranks of both stages (the draft with the last)."""
    model = tiny.model("llama")
    artifact = tmp_path / "tiny-tp4-pp2"
    convert(str(model), artifact, Options(tp=4, pp=2, draft=str(tiny.draft("eagle3", model))),
            progress=False)  # fmt: skip
    repo = "shardprep-test/Tiny-TP4-PP2"
    publish(artifact, repo, endpoint=hub.endpoint, progress=False)
    files = _manifest(artifact).files
    extras = {e.path for e in _manifest(artifact).side_files}

    def paths(stages: set[int], ranks: set[int]) -> set[str]:
        return {f.path for f in files if f.pp in stages and f.tp in ranks}

    argv = ["fetch", repo, "--stage", "1", "--rank", "1", "--tp", "2", "--endpoint", hub.endpoint]
    assert cli.main([*argv, "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["stage"], out["rank"], out["tp"]) == (1, 1, 2)
    assert set(_requested(hub)) == paths({1}, {2, 3}) | extras | {MANIFEST_NAME}
    assert any(p.startswith("draft/shards/") for p in paths({1}, {2, 3}))
    folder = Path(out["path"])
    assert all((folder / p).read_bytes() == (artifact / p).read_bytes() for p in paths({1}, {2, 3}))

    before = len(_requested(hub))
    assert fetch(repo, stage=0, rank=1, pp=1, tp=2, endpoint=hub.endpoint, progress=False) == folder
    assert set(_requested(hub)[before:]) == paths({0}, {2, 3})  # stage 1's ranks are cached
    assert not any((folder / p).exists() for p in paths({0, 1}, {0, 1}))

    with pytest.raises(ConfigError, match="--tp 2 needs --rank"):
        fetch(repo, stage=0, tp=2, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="at --tp 3: tp3 is not a divisor of the artifact's tp4"):
        fetch(repo, stage=0, rank=0, tp=3, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="rank 2 is not one of the 2 ranks of tp2"):
        fetch(repo, stage=0, rank=2, tp=2, endpoint=hub.endpoint)


def test_the_parts_a_vllm_worker_fetches(artifact: Path) -> None:
    """What each worker of vLLM fetches from a tp2 x pp2 artifact of 4 layers: its own
    rank at the artifact's topology, the ranks and stages its rank is made of elsewhere;
    a draft's are the artifact's last stage; a tp that does not divide is refused."""
    manifest = _manifest(artifact)
    assert worker_parts(manifest, REPO, "target", 1, 2, 1, (2, 2)) == [Part(1, 1)]
    assert worker_parts(manifest, REPO, "draft", 1, 2, 1, None) == [Part(1, 1)]
    assert worker_parts(manifest, REPO, "target", 0, 1, 0, (4,)) == [
        Part(0, 0), Part(0, 1), Part(1, 0), Part(1, 1)
    ]  # fmt: skip
    assert worker_parts(manifest, REPO, "target", 1, 1, 0, (2, 2)) == [Part(1, 0), Part(1, 1)]
    assert worker_parts(manifest, REPO, "target", 2, 2, 0, (1, 2, 1)) == [Part(1, 0)]
    assert worker_parts(manifest, REPO, "draft", 0, 1, 0, None) == [Part(1, 0), Part(1, 1)]
    with pytest.raises(TopologyMismatchError) as info:
        worker_parts(manifest, REPO, "target", 0, 4, 0, (4,))
    assert str(info.value) == (
        f"{REPO} is tp2 x pp2 and serves tp 1, 2 x any pp; vLLM runs tp4 x pp1 (layers 4), "
        "which it cannot serve; start vLLM at a topology it serves, or convert again with "
        "--tp 4 --pp 1"
    )


_FETCH_AND_CHECK = """
import hashlib, json, sys
from shardprep.hub.cache import fetch
from shardprep.format.manifest import read_manifest
folder = fetch(sys.argv[1], stage=1, endpoint=sys.argv[2])
manifest = read_manifest(folder)
bad = [
    f.path for f in manifest.files
    if f.pp == 1 and hashlib.sha256((folder / f.path).read_bytes()).hexdigest() != f.sha256
]
print(json.dumps({"folder": str(folder), "bad": bad}))
"""


def test_four_processes_download_a_stage_once(
    hub: HubServer, artifact: Path, published: str, tmp_path: Path
) -> None:
    """The test holds the stage lock until all four are waiting on it, then lets them go."""
    lock_path = repo_folder(REPO) / published / STATE_DIR / "locks" / "stage-1.lock"
    lock_path.parent.mkdir(parents=True)
    lock = FileLock(lock_path)
    command = [sys.executable, "-c", _FETCH_AND_CHECK, REPO, hub.endpoint]
    logs = [tmp_path / f"stderr-{i}.txt" for i in range(4)]
    with lock:
        procs = [
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
            for log in logs
        ]
        deadline = time.monotonic() + 60
        while not all("fetching stage 1" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            assert all(proc.poll() is None for proc in procs), [log.read_text() for log in logs]
            time.sleep(0.05)
    results = []
    for proc, log in zip(procs, logs, strict=True):
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, log.read_text()
        results.append(json.loads(out.strip().splitlines()[-1]))

    assert {r["folder"] for r in results} == {str(repo_folder(REPO) / published)}
    assert all(r["bad"] == [] for r in results)
    for path in [MANIFEST_NAME, *_wanted_paths(artifact, 1)]:
        assert hub.downloads(REPO, path) == 1, path


def test_a_corrupt_blob_fails_loudly_and_places_nothing(
    hub: HubServer, artifact: Path, published: str
) -> None:
    bad = "shards/model-pp-1-tp-0-part-0.safetensors"
    hub.corrupt_blob(REPO, bad)
    with pytest.raises(CorruptFileError) as err:
        fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)

    message = str(err.value)
    assert f"{bad} has sha256 " in message
    assert "on two downloads in a row" in message
    assert f"shardprep publish OUT {REPO}" in message
    assert err.value.path == bad
    assert hub.downloads(REPO, bad) == 2  # fetched again once, then given up
    folder = repo_folder(REPO) / published
    assert not (folder / bad).exists()
    assert not (folder / MANIFEST_NAME).exists()  # no stage is complete
    staging = folder / STATE_DIR / "staging" / "stage-1"
    assert Path(bad) not in {path.relative_to(staging) for path in _files_under(staging)}

    # repaired on the Hub (the flip undone): a rerun downloads only the missing file
    hub.corrupt_blob(REPO, bad)
    fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)
    assert (folder / bad).read_bytes() == (artifact / bad).read_bytes()
    assert hub.downloads(REPO, bad) == 3
    others = [p for p in _wanted_paths(artifact, 1) if p != bad]
    assert all(hub.downloads(REPO, path) == 1 for path in others)


def test_a_cut_download_completes_with_the_right_bytes(
    hub: HubServer, artifact: Path, published: str
) -> None:
    path = "shards/model-pp-1-tp-1-part-0.safetensors"
    hub.cut_next_download(REPO, path, after_bytes=(artifact / path).stat().st_size // 2)
    folder = fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)
    assert (folder / path).read_bytes() == (artifact / path).read_bytes()
    assert hub.downloads(REPO, path) == 2


def test_compressed_round_trip_is_byte_identical(
    hub: HubServer, artifact: Path, published: str
) -> None:
    """Published plain first, then compressed: the second commit drops the plain shards."""
    commit = publish(artifact, REPO, compress="zstd", endpoint=hub.endpoint, progress=False)
    assert commit != published
    remote = set(HfApi(endpoint=hub.endpoint).list_repo_files(REPO, revision=commit))
    shards = [f.path for f in _manifest(artifact).files]
    assert {p + ".zst" for p in shards} <= remote
    assert not set(shards) & remote
    assert not (artifact / ".shardprep-publish").exists()

    folder = fetch(REPO, all_stages=True, endpoint=hub.endpoint, progress=False)
    for path in shards + [e.path for e in _manifest(artifact).side_files]:
        assert (folder / path).read_bytes() == (artifact / path).read_bytes(), path
    assert not any(p.suffix == ".zst" for p in _files_under(folder))
    manifest = read_manifest(folder)
    assert {f.codec for f in manifest.files} == {"zstd"}
    assert all(f.stored_bytes and f.stored_sha256 for f in manifest.files)
    assert verify(folder).ok


def test_offline_fetch_of_a_cached_stage_sends_no_request(
    hub: HubServer, artifact: Path, published: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)
    before = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    assert fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False) == folder
    assert fetch(REPO, stage=1, revision=published, progress=False) == folder
    assert ensure_stage(REPO, 1) == folder
    assert len(hub.requests) == before
    with pytest.raises(HubError, match="stage 0 of .* is not in the cache .*HF_HUB_OFFLINE"):
        fetch(REPO, stage=0, endpoint=hub.endpoint, progress=False)
    with pytest.raises(HubError, match="has never fetched .*@v2"):
        fetch(REPO, stage=1, revision="v2", progress=False)
    assert len(hub.requests) == before


def test_an_unreachable_hub_falls_back_to_the_cached_stage(
    hub: HubServer, artifact: Path, published: str
) -> None:
    endpoint = hub.endpoint
    folder = fetch(REPO, stage=1, endpoint=endpoint, progress=False)
    hub.stop()
    assert fetch(REPO, stage=1, endpoint=endpoint, progress=False) == folder
    with pytest.raises(HubError, match="Fetch it once with network access"):
        fetch(REPO, stage=0, endpoint=endpoint, progress=False)


def test_publish_refuses_a_damaged_artifact(hub: HubServer, artifact: Path, tmp_path: Path):
    damaged = tmp_path / "damaged"
    shutil.copytree(artifact, damaged)
    shard = damaged / "shards/model-pp-0-tp-1-part-0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(CorruptFileError) as err:
        publish(damaged, REPO, endpoint=hub.endpoint, progress=False)
    message = str(err.value)
    assert message.startswith(f"Refusing to publish {damaged}: it fails verification (")
    assert "shards/model-pp-0-tp-1-part-0.safetensors does not match its sha256" in message
    assert "`shardprep verify" in message
    assert hub.requests == []


def test_the_model_card_has_metadata_and_commands(
    hub: HubServer, artifact: Path, published: str, tmp_path: Path
) -> None:
    readme = hf_hub_download(
        REPO, "README.md", revision=published, endpoint=hub.endpoint, local_dir=tmp_path / "c"
    )
    card = ModelCard.load(readme)
    assert card.data.library_name == "vllm"
    assert card.data.tags == ["shardprep", "vllm", "tp2", "pp2"]
    text = card.text
    assert f"MODEL=$(shardprep fetch {REPO} --stage $STAGE --quiet)" in text
    assert (
        'vllm serve "$MODEL" --tensor-parallel-size 2 --pipeline-parallel-size 2 '
        "--load-format sharded-fast" in text
    )
    assert '\\"model\\": \\"$MODEL/draft\\"' in text
    assert "| 1 | draft | 0 | 1 |" in text  # the size table has the draft's ranks on stage 1
    assert "stage 1: layers 2-3" in text
    assert "- serves: tp 1, 2 x any pp (`--load-format sharded-fast`)" in text
    assert "EAGLE3 draft" in text

    manifest = _manifest(artifact)
    source = Source(
        model="meta-llama/Llama-3.1-8B",
        repo_id="meta-llama/Llama-3.1-8B",
        revision="0e9e39f249a16976918f6564b8830bc894c89659",
        files=(),
    )
    models = tuple(replace(m, source=source) if m.role == "target" else m for m in manifest.models)
    renamed = replace(manifest, models=models)
    card = ModelCard(model_card(renamed, REPO))
    assert card.data.base_model == "meta-llama/Llama-3.1-8B"
    assert "at revision `0e9e39f249a16976918f6564b8830bc894c89659`" in card.text


def test_cli_publish_and_fetch(
    hub: HubServer, artifact: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["publish", str(artifact), REPO, "--compress", "zstd", "--endpoint", hub.endpoint]
    assert cli.main([*argv, "--json", "-q"]) == 0
    published = json.loads(capsys.readouterr().out)
    assert published["commit"] == hub.head(REPO)
    assert published["compress"] == "zstd"

    cache = tmp_path / "elsewhere"
    argv = ["fetch", REPO, "--stage", "0", "--cache-dir", str(cache), "--endpoint", hub.endpoint]
    assert cli.main([*argv, "-q"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder == cache / "models--shardprep-test--Tiny-TP2-PP2" / published["commit"]
    assert all((folder / p).is_file() for p in _wanted_paths(artifact, 0))

    assert cli.main(["fetch", REPO, "--endpoint", hub.endpoint, "-q"]) == 1
    assert "pass --stage P (the stage this node serves, one of 0, 1) or --all" in (
        capsys.readouterr().err
    )


def test_bad_requests_say_what_to_do(hub: HubServer, published: str) -> None:
    with pytest.raises(ConfigError, match="--rank 1 needs --stage"):
        fetch(REPO, rank=1, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="holds stage\\(s\\) 0, 1 of pp=2, not stage 2"):
        fetch(REPO, stage=2, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="tp=2: --rank takes 0 to 1, not 2"):
        fetch(REPO, stage=0, rank=2, endpoint=hub.endpoint)
    with pytest.raises(HubError, match="shardprep-test/missing is not on"):
        fetch("shardprep-test/missing", stage=0, endpoint=hub.endpoint)
    with pytest.raises(ConfigError, match="choose zstd"):
        publish(Path("."), REPO, compress="gzip", endpoint=hub.endpoint)


def test_ensure_stage_returns_a_local_folder_as_it_is(artifact: Path) -> None:
    assert ensure_stage(str(artifact), 0) == artifact
    with pytest.raises(ConfigError, match="neither a folder nor a Hub repo id"):
        ensure_stage("./no/such/folder", 0)


def test_a_corrupt_compressed_file_or_manifest_is_named(
    hub: HubServer, artifact: Path, tmp_path: Path
) -> None:
    publish(artifact, REPO, compress="zstd", endpoint=hub.endpoint, progress=False)
    bad = "draft/shards/model-pp-1-tp-1-part-0.safetensors.zst"
    hub.corrupt_blob(REPO, bad)
    with pytest.raises(CorruptFileError, match=f"{bad} has sha256 .* on two downloads"):
        fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)
    assert hub.downloads(REPO, bad) == 2

    hub.corrupt_blob(REPO, MANIFEST_NAME)
    with pytest.raises(CorruptFileError, match=f"{MANIFEST_NAME} does not match the git-sha1"):
        fetch(REPO, stage=0, cache_dir=tmp_path / "fresh", endpoint=hub.endpoint, progress=False)
    assert hub.downloads(REPO, MANIFEST_NAME) == 3  # once above, twice here


def test_publish_and_fetch_log_plain_lines_outside_a_terminal(
    hub: HubServer, artifact: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """stderr is not a terminal here: no carriage return, no escape code, from shardprep's
    bars or huggingface_hub's nested ones."""
    assert cli.main(["publish", str(artifact), REPO, "--endpoint", hub.endpoint]) == 0
    cache = tmp_path / "cache"
    argv = ["fetch", REPO, "--all", "--cache-dir", str(cache), "--endpoint", hub.endpoint]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    assert "verify: 100%" in err and any(line.endswith("B/s]") for line in err.splitlines())


def test_a_decompression_bomb_fails_at_once_and_places_nothing(
    hub: HubServer, artifact: Path, tmp_path: Path
) -> None:
    """A crafted repo whose manifest names a 46 KB `.zst` (sha256 right) that claims 1,000
    bytes and holds 1 GiB of zeros: one download, refused at its first frame, no retry."""
    crafted = tmp_path / "crafted"
    shutil.copytree(artifact, crafted)
    manifest = _manifest(crafted)
    target = "shards/model-pp-1-tp-0-part-0.safetensors"
    data = bomb(claimed_bytes=1000, frames=256)
    (crafted / target).unlink()
    (crafted / (target + ".zst")).write_bytes(data)
    files = tuple(
        replace(
            f,
            bytes=1000,
            codec="zstd",
            stored_bytes=len(data),
            stored_sha256=hashlib.sha256(data).hexdigest(),
        )
        if f.path == target
        else f
        for f in manifest.files
    )
    write_manifest(crafted, replace(manifest, files=files))
    HfApi(endpoint=hub.endpoint).create_repo(REPO)
    HfApi(endpoint=hub.endpoint).upload_folder(repo_id=REPO, folder_path=crafted)

    started = time.monotonic()
    with pytest.raises(CorruptFileError) as err:
        fetch(REPO, stage=1, endpoint=hub.endpoint, progress=False)
    assert time.monotonic() - started < 30
    message = str(err.value)
    assert "\n" not in message
    assert f"{target}.zst matches the sha256 in {MANIFEST_NAME} but does not decompress" in message
    assert "frame 0 would restore 4,194,304 bytes at offset 0 of a file its header says " in message
    assert err.value.path == target + ".zst"
    assert hub.downloads(REPO, target + ".zst") == 1
    folder = repo_folder(REPO) / hub.head(REPO)
    staging = folder / STATE_DIR / "staging" / "stage-1"
    assert [p for p in (folder, staging) if (p / target).exists()] == []
    assert not (staging / (target + ".zst")).exists()
    assert list((staging / "shards").glob("*.incomplete")) == []
    assert not (folder / MANIFEST_NAME).exists()
    assert sum(p.stat().st_size for p in _files_under(folder)) < 10 * 1024**2


def test_publish_refuses_a_linked_staging_folder(
    hub: HubServer, artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (copy / ".shardprep-publish").symlink_to(elsewhere, target_is_directory=True)
    assert cli.main(["publish", str(copy), REPO, "--endpoint", hub.endpoint, "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and err.count("\n") == 1
    assert f"{copy / '.shardprep-publish'} is a symbolic link" in err
    assert list(elsewhere.iterdir()) == []


def test_publish_never_writes_through_links_in_its_staging_folder(
    hub: HubServer, artifact: Path, tmp_path: Path
) -> None:
    """Links to a file and a folder outside, planted at the names publish writes in its
    staging folder (the card, the manifest, the compression journal and its temporary
    name, a copied file, the shards folder): the upload is right, nothing outside moved."""
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    staging = copy / ".shardprep-publish"
    staging.mkdir()
    for name in ["README.md", MANIFEST_NAME, ".compressed.json", ".compressed.json.incomplete"]:
        (staging / name).symlink_to(victim)
    (staging / "config.json").symlink_to(victim)
    (staging / "shards").symlink_to(elsewhere, target_is_directory=True)
    publish(copy, REPO, compress="zstd", endpoint=hub.endpoint, progress=False)
    assert victim.read_text() == "the user's\n" and list(elsewhere.iterdir()) == []
    assert not staging.exists()
    folder = fetch(REPO, stage=0, endpoint=hub.endpoint, progress=False)
    for path in _wanted_paths(artifact, 0):
        assert (folder / path).read_bytes() == (artifact / path).read_bytes(), path


def test_the_cache_files_take_the_umask_mode(
    hub: HubServer, published: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-m", "shardprep.cli", "fetch", REPO, "--stage", "1", "-q",
         "--cache-dir", str(cache), "--endpoint", hub.endpoint],
        capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o022),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    modes = {
        str(p.relative_to(cache)): oct(p.stat().st_mode & 0o777)
        for p in cache.rglob("*")
        if p.is_file()
    }
    assert any("/.shardprep/done/" in p for p in modes) and any("/refs/" in p for p in modes)
    assert modes == dict.fromkeys(modes, oct(0o644))
