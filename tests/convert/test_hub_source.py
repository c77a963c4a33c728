"""A Hub repo id as the source of `plan` and `convert`, through the test Hub
(tests/support/hub_server.py) and the real huggingface_hub client: `plan` reads headers by
range request only, a one-stage convert downloads only the files holding its tensors (into
the Hugging Face cache, each checked against the sha256 the Hub states), and its rank files
equal a full convert's.

The test model's stages live in different files: embeddings and layers 0-1 in the first,
layers 2-3 in the second, the final norm and lm_head in the third, so stage 1 of pp=2 needs
the second and third only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from stat import S_ISREG

import hub_stages
import pytest
from hub_server import HubServer
from hub_stages import (
    DRAFT,
    FIRST,
    HEADER_LIMIT,
    REPO,
    SECOND,
    THIRD,
    WEIGHTS,
    body_ranges,
    files_fetched,
    hub_options,
    sha256_of,
    split_by_stage,
    stage_shards,
)
from huggingface_hub import HfApi, try_to_load_from_cache

from shardprep.constants import MANIFEST_NAME, MAX_HEADER_BYTES, SOURCE_DOWNLOAD_DIR
from shardprep.convert.hub_source import files_for_plan
from shardprep.convert.run import Options, convert, load_and_plan
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.errors import ConfigError, CorruptFileError, HubError

# The client's own LFS PUT passes a file object as `data=`, which httpx2 deprecates.
model, repo = hub_stages.model, hub_stages.repo  # the fixtures of these tests
pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]


def test_plan_reads_headers_by_range_only(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    plan, checkpoints = load_and_plan(REPO, hub_options(hub))
    for file in WEIGHTS:
        served = hub.bytes_served(REPO, file)
        assert 8 < served <= HEADER_LIMIT, (file, served)
        assert hub.download_ranges(REPO, file) and all(hub.download_ranges(REPO, file)), file
    assert checkpoints["target"].revision == repo  # "main", resolved once to its commit
    local, _ = load_and_plan(str(model), Options(tp=2, pp=2))
    assert plan == local
    # The same through the command line, reading the endpoint and token from the environment.
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "cli-home")}
    command = [sys.executable, "-m", "shardprep.cli", "plan", REPO, "--tp", "2", "--pp", "2"]
    result = subprocess.run(
        [*command, "--revision", repo, "--json", "--quiet"],
        capture_output=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout)["models"], result.stdout
    assert all(hub.bytes_served(REPO, f) <= 2 * HEADER_LIMIT for f in WEIGHTS)


def test_one_stage_downloads_only_its_files(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    stage = convert(REPO, tmp_path / "stage1", hub_options(hub, stage=1), progress=False)
    assert hub.bytes_served(REPO, FIRST) <= HEADER_LIMIT  # stage 0's file: its header only
    for file in (SECOND, THIRD):
        assert hub.bytes_served(REPO, file) <= HEADER_LIMIT + (model / file).stat().st_size
        cached = try_to_load_from_cache(REPO, file, revision=repo)
        assert isinstance(cached, str) and Path(cached).read_bytes() == (model / file).read_bytes()
    assert try_to_load_from_cache(REPO, FIRST, revision=repo) is None
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2), progress=False)
    assert stage_shards(tmp_path / "stage1", 1) == stage_shards(full, 1) and stage_shards(full, 1)
    source = stage.model("target").source
    assert (source.repo_id, source.revision) == (REPO, repo)
    assert [(f.path, f.bytes, f.sha256) for f in source.files] == [
        (f, (model / f).stat().st_size, sha256_of(model / f)) for f in WEIGHTS
    ]
    # A full convert from the Hub downloads the rest once and equals the local one.
    from_hub = convert(REPO, tmp_path / "hub-full", hub_options(hub), progress=False)
    assert stage_shards(tmp_path / "hub-full", 0) == stage_shards(full, 0)
    assert stage_shards(tmp_path / "hub-full", 1) == stage_shards(full, 1)
    assert from_hub.model("target").source.files == source.files
    assert hub.downloads(REPO, SECOND) == len(hub.download_ranges(REPO, SECOND))


def test_a_wrong_sha256_is_refused_then_a_rerun_converts(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    hub.corrupt_blob(REPO, SECOND)
    with pytest.raises(CorruptFileError) as refused:
        convert(REPO, out, hub_options(hub, stage=1), progress=False)
    message = str(refused.value)
    assert "\n" not in message and SECOND in message and "the Hub states" in message
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("shards/*"))
    assert try_to_load_from_cache(REPO, SECOND, revision=repo) is None
    hub.corrupt_blob(REPO, SECOND)  # the same byte flipped back
    convert(REPO, out, hub_options(hub, stage=1), progress=False)
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2, stage=1), progress=False)
    assert stage_shards(out, 1) == stage_shards(full, 1)


def test_a_cut_download_resumes_with_identical_bytes(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    size = (model / SECOND).stat().st_size
    hub.cut_next_download(REPO, SECOND, size // 2)
    convert(REPO, tmp_path / "out", hub_options(hub, stage=1), progress=False)
    # The client asked again, for the rest only: every byte of the body was sent once.
    assert body_ranges(hub, SECOND) == [None, f"bytes={size // 2}-"], hub.download_ranges(
        REPO, SECOND
    )
    assert hub.bytes_served(REPO, SECOND) <= HEADER_LIMIT + size
    cached = try_to_load_from_cache(REPO, SECOND, revision=repo)
    assert isinstance(cached, str) and Path(cached).read_bytes() == (model / SECOND).read_bytes()
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2, stage=1), progress=False)
    assert stage_shards(tmp_path / "out", 1) == stage_shards(full, 1)


def _cli_convert(
    hub: HubServer, out: Path, *flags: str, home: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    if home is not None:
        env["HF_HOME"] = str(home)
    command = [sys.executable, "-m", "shardprep.cli", "convert", REPO, "--tp", "2", "--pp", "2"]
    return [*command, "--stage", "1", "-o", str(out), *flags], env


def test_a_killed_convert_resumes_the_file_it_was_downloading(
    hub: HubServer, repo: str, model: Path, tmp_path: Path, hf_client_env: Path
) -> None:
    size = (model / SECOND).stat().st_size
    cut = size // 2
    stall = hub.stall_next_download(REPO, SECOND, cut)
    out = tmp_path / "out"
    command, env = _cli_convert(hub, out, "--quiet")
    storage = hf_client_env / "hub" / f"models--{REPO.replace('/', '--')}"
    partial = storage / "blobs" / f"{sha256_of(model / SECOND)}.incomplete"
    _kill_when_stalled(command, env, partial, cut, stall)
    assert partial.stat().st_size == cut  # what the killed run received is kept
    resumed = convert(REPO, out, hub_options(hub, stage=1), progress=False)
    # The rerun hashed the half it found and asked for the other half only.
    assert body_ranges(hub, SECOND) == [None, f"bytes={cut}-"], hub.download_ranges(REPO, SECOND)
    assert hub.bytes_served(REPO, SECOND) <= 2 * HEADER_LIMIT + size
    assert not partial.exists()
    cached = try_to_load_from_cache(REPO, SECOND, revision=repo)
    assert isinstance(cached, str) and Path(cached).read_bytes() == (model / SECOND).read_bytes()
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2, stage=1), progress=False)
    assert stage_shards(out, 1) == stage_shards(full, 1) and stage_shards(full, 1)
    recorded = {f.path: f.sha256 for f in resumed.model("target").source.files}
    assert recorded[SECOND] == sha256_of(model / SECOND)


def test_a_killed_budgeted_convert_resumes_its_partial_download(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    """With --source-budget, what a killed run received is kept in the private folder
    (`partial/<sha256>.incomplete`), counted in the budget, and resumed by the rerun."""
    size = (model / SECOND).stat().st_size
    cut = size // 2
    budget = 2 * size  # the kept half plus the largest file fit: it is resumed
    stall = hub.stall_next_download(REPO, SECOND, cut)
    out = tmp_path / "out"
    command, env = _cli_convert(hub, out, "--quiet", "--source-budget", f"{budget}B")
    partial = out / SOURCE_DOWNLOAD_DIR / "partial" / f"{sha256_of(model / SECOND)}.incomplete"
    _kill_when_stalled(command, env, partial, cut, stall)
    peaks: list[int] = []

    def watch() -> None:
        peaks.append(_folder_bytes(out / SOURCE_DOWNLOAD_DIR))

    options = hub_options(hub, stage=1, source_budget=budget)
    convert(REPO, out, options, progress=False, source_watch=watch)
    assert body_ranges(hub, SECOND) == [None, f"bytes={cut}-"], hub.download_ranges(REPO, SECOND)
    assert peaks and max(peaks) <= budget, peaks
    assert not (out / SOURCE_DOWNLOAD_DIR).exists()
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2, stage=1), progress=False)
    assert stage_shards(out, 1) == stage_shards(full, 1) and stage_shards(full, 1)


def test_progress_shows_both_streams_unless_quiet_or_json(
    hub: HubServer, repo: str, tmp_path: Path
) -> None:
    shown = {}
    for flags in ((), ("--quiet",), ("--json",)):
        name = "-".join(f.strip("-") for f in flags) or "plain"
        command, env = _cli_convert(hub, tmp_path / name, *flags, home=tmp_path / f"home-{name}")
        result = subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr.decode()
        shown[name] = (result.stdout.decode(), result.stderr.decode())
    # Not a terminal: plain lines, one bar for the bytes downloaded and one for those converted.
    lines = shown["plain"][1].splitlines()
    downloaded = [line for line in lines if line.startswith("download:")]
    converted = [line for line in lines if line.startswith("convert:")]
    assert downloaded and "100%" in downloaded[-1], lines
    assert converted and "100%" in converted[-1], lines
    assert all(line.startswith(("download:", "convert:")) for line in lines), lines
    assert shown["quiet"][1] == "" and shown["json"][1] == "", shown
    assert json.loads(shown["json"][0])["written_files"], shown["json"][0]


def test_offline_reads_the_cache_or_says_what_it_lacks(
    hub: HubServer, repo: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    convert(REPO, tmp_path / "stage1", hub_options(hub, stage=1), progress=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as partial:
        load_and_plan(REPO, hub_options(hub))
    assert "HF_HUB_OFFLINE" in str(partial.value) and FIRST in str(partial.value)
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        load_and_plan("shardprep-test/never-fetched", hub_options(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    convert(REPO, tmp_path / "full", hub_options(hub), progress=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline, checkpoints = load_and_plan(REPO, hub_options(hub))
    assert checkpoints["target"].revision == repo
    assert offline == load_and_plan(str(model), Options(tp=2, pp=2))[0]


def test_a_draft_repo_is_fetched_only_for_the_last_stage(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    draft = make_tiny_draft(tmp_path / "draft", model, "eagle3")
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(DRAFT)
    api.upload_folder(repo_id=DRAFT, folder_path=draft)
    weights = sorted(p.name for p in draft.glob("*.safetensors"))
    options = hub_options(hub, stage=0, draft=DRAFT)
    plan, checkpoints = load_and_plan(REPO, options)
    assert files_for_plan(plan, checkpoints["draft"], ["draft"]) == []
    convert(REPO, tmp_path / "stage0", options, progress=False)
    assert weights and all(hub.bytes_served(DRAFT, f) <= HEADER_LIMIT for f in weights)
    assert hub.bytes_served(REPO, THIRD) <= HEADER_LIMIT
    assert (
        files_fetched(hub, REPO, WEIGHTS) == {FIRST} and files_fetched(hub, DRAFT, weights) == set()
    )
    options = hub_options(hub, stage=1, draft=DRAFT)
    plan, checkpoints = load_and_plan(REPO, options)
    stage1 = convert(REPO, tmp_path / "stage1", options, progress=False)
    assert all(hub.bytes_served(DRAFT, f) > HEADER_LIMIT for f in weights)
    # Exactly the files the plan reads, each downloaded once.
    assert files_fetched(hub, DRAFT, weights) == set(
        files_for_plan(plan, checkpoints["draft"], ["draft"])
    )
    assert files_fetched(hub, REPO, WEIGHTS) == {FIRST, SECOND, THIRD}
    assert all(len(body_ranges(hub, f, DRAFT)) == 1 for f in weights)
    local = tmp_path / "local"
    convert(str(model), local, Options(tp=2, pp=2, stage=1, draft=str(draft)), progress=False)
    drafted = sorted((local / "draft" / "shards").iterdir())
    assert drafted and [p.read_bytes() for p in drafted] == [
        (tmp_path / "stage1" / "draft" / "shards" / p.name).read_bytes() for p in drafted
    ]
    assert stage_shards(tmp_path / "stage1", 1) == stage_shards(local, 1)
    assert stage1.model("draft").source.repo_id == DRAFT


def test_a_server_without_ranges_is_one_line(model: Path, tmp_path: Path) -> None:
    with HubServer(tmp_path / "hub_storage", ignore_ranges=True) as plain:
        api = HfApi(endpoint=plain.endpoint)
        api.create_repo(REPO)
        api.upload_folder(repo_id=REPO, folder_path=model)
        with pytest.raises(HubError) as refused:
            load_and_plan(REPO, Options(tp=2, pp=2, endpoint=plain.endpoint))
    message = str(refused.value)
    assert "\n" not in message and "did not answer a range request" in message, message


def test_a_header_too_large_is_refused_before_it_is_read(
    hub: HubServer, model: Path, tmp_path: Path
) -> None:
    hostile = tmp_path / "hostile"
    shutil.copytree(model, hostile)
    data = bytearray((hostile / SECOND).read_bytes())
    data[:8] = struct.pack("<Q", MAX_HEADER_BYTES + 1)
    (hostile / SECOND).write_bytes(data)
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=hostile)
    with pytest.raises(CorruptFileError, match="over the .* limit"):
        load_and_plan(REPO, hub_options(hub))
    assert hub.download_ranges(REPO, SECOND) == ["bytes=0-7"]


def _folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (links to the cache not counted), each
    inode once: a download renamed into place while the folder is walked (from another
    thread) is otherwise seen at both names."""
    sizes = {}
    for path in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            info = path.lstat()
            if S_ISREG(info.st_mode):  # not a link
                sizes[info.st_ino] = info.st_size
    return sum(sizes.values())


def test_a_source_budget_bounds_the_source_on_disk(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    sizes = {f: (model / f).stat().st_size for f in WEIGHTS}
    budget = max(sizes.values()) + min(sizes.values()) - 1  # never all three, nor the two largest
    assert budget < sum(sorted(sizes.values())[1:])
    out = tmp_path / "budget"
    peaks: list[int] = []

    def watch() -> None:
        private = out / SOURCE_DOWNLOAD_DIR
        peaks.append(_folder_bytes(private) if private.is_dir() else 0)

    convert(REPO, out, hub_options(hub, source_budget=budget), progress=False, source_watch=watch)
    assert max(peaks) <= budget and max(peaks) >= max(sizes.values()), peaks
    assert len(peaks) >= 3 * len(WEIGHTS)  # each file: start, finish, delete
    assert not (out / SOURCE_DOWNLOAD_DIR).exists()
    for file in WEIGHTS:  # downloaded whole, once, into the private folder only
        assert hub.bytes_served(REPO, file) <= HEADER_LIMIT + sizes[file]
        assert try_to_load_from_cache(REPO, file, revision=repo) is None
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2), progress=False)
    for stage in (0, 1):
        assert stage_shards(out, stage) == stage_shards(full, stage) and stage_shards(full, stage)
    assert (out / "config.json").read_bytes() == (model / "config.json").read_bytes()


def test_a_file_over_the_source_budget_is_one_line(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    largest = max(WEIGHTS, key=lambda f: (model / f).stat().st_size)
    size = (model / largest).stat().st_size
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as refused:
        convert(REPO, out, hub_options(hub, source_budget=size - 1), progress=False)
    message = str(refused.value)
    assert "\n" not in message and largest in message and f"({size} bytes)" in message
    assert not (out / MANIFEST_NAME).exists() and not list(out.glob("shards/*"))
    assert all(hub.bytes_served(REPO, f) <= HEADER_LIMIT for f in WEIGHTS)
    # The command line refuses it the same way, in one line and no traceback.
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    command = [sys.executable, "-m", "shardprep.cli", "convert", REPO, "--tp", "2", "--pp", "2"]
    result = subprocess.run(
        [*command, "-o", str(out), "--source-budget", f"{size - 1}B", "--quiet"],
        capture_output=True,
        timeout=300,
        env=env,
        check=False,
    )
    stderr = result.stderr.decode().strip()
    assert result.returncode != 0 and largest in stderr and "Traceback" not in stderr, stderr


def test_an_expert_parallel_stage_downloads_only_its_files(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dp 2 with expert parallelism at pp=2, each stage into a fresh cache: a stage
    downloads the files of the tensors its plan reads (every expert of its layers, spread
    over the EP ranks), each once, and nothing else. vLLM's Qwen3-MoE builds the embedding,
    the final norm and lm_head on every stage: they are in FIRST, which both stages read;
    layers 0-1 are in SECOND, layers 2-3 in THIRD."""
    from huggingface_hub import constants

    def file_of(name: str) -> str:
        if not name.startswith("model.layers."):
            return FIRST
        return SECOND if int(name.split(".")[2]) < 2 else THIRD

    repo = "shardprep-test/moe-by-stage"
    moe = make_tiny_model(tmp_path / "moe", "Qwen3MoeForCausalLM", torch_dtype="bfloat16")
    split_by_stage(moe, file_of)
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(repo)
    api.upload_folder(repo_id=repo, folder_path=moe)
    ep = {"tp": 1, "pp": 2, "dp": 2, "expert_parallel": True, "endpoint": hub.endpoint}
    wanted = {0: {FIRST, SECOND}, 1: {FIRST, THIRD}}
    for stage in (0, 1):
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / f"cache{stage}"))
        before = {f: len(body_ranges(hub, f, repo)) for f in WEIGHTS}
        options = Options(stage=stage, **ep)  # type: ignore[arg-type]
        plan, checkpoints = load_and_plan(repo, options)
        assert set(files_for_plan(plan, checkpoints["target"], ["target"])) == wanted[stage]
        out = tmp_path / f"stage{stage}"
        convert(repo, out, options, progress=False)
        fetched = {f: len(body_ranges(hub, f, repo)) - before[f] for f in WEIGHTS}
        assert fetched == {f: int(f in wanted[stage]) for f in WEIGHTS}, fetched
        local = tmp_path / f"local{stage}"
        convert(str(moe), local, dataclasses.replace(options, endpoint=None), progress=False)
        shards = stage_shards(out, stage)
        assert shards == stage_shards(local, stage) and len(shards) == 3, sorted(shards)


def test_each_file_is_converted_as_it_arrives_whatever_its_place(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    """FIRST's download stalls halfway; the files after it arrive and are converted (and,
    within a budget, deleted) meanwhile. Then the server hangs up on FIRST: the client asks
    for its second half only, and the rank files equal a local convert's."""
    size = (model / FIRST).stat().st_size
    stall = hub.stall_next_download(REPO, FIRST, size // 2)
    out = tmp_path / "out"
    seen: set[str] = set()
    overtaken: list[set[str]] = []

    def watch() -> None:
        """Called as downloads start and end and before a converted file is deleted."""
        here = {p.name for p in (out / SOURCE_DOWNLOAD_DIR).rglob("*") if p.is_file()}
        if FIRST not in here and seen - here:  # a file after FIRST converted and deleted
            overtaken.append(here)
            stall.set()
        seen.update(here & {SECOND, THIRD})

    budget = sum((model / f).stat().st_size for f in WEIGHTS)
    options = hub_options(hub, source_budget=budget)
    convert(REPO, out, options, progress=False, source_watch=watch)
    assert overtaken and f"{sha256_of(model / FIRST)}.incomplete" in overtaken[0], overtaken
    assert body_ranges(hub, FIRST) == [None, f"bytes={size // 2}-"], hub.download_ranges(
        REPO, FIRST
    )
    full = tmp_path / "full"
    convert(str(model), full, Options(tp=2, pp=2), progress=False)
    for stage in (0, 1):
        assert stage_shards(out, stage) == stage_shards(full, stage) and stage_shards(full, stage)


def test_a_header_read_cut_short_is_asked_again(
    hub: HubServer, repo: str, model: Path, tmp_path: Path
) -> None:
    hub.cut_next_download(REPO, SECOND, 4)  # the first range read, of its 8-byte length
    plan, _ = load_and_plan(REPO, hub_options(hub))
    ranges = hub.download_ranges(REPO, SECOND)
    assert ranges[:2] == ["bytes=0-7", "bytes=0-7"] and len(ranges) == 3, ranges
    assert plan == load_and_plan(str(model), Options(tp=2, pp=2))[0]


def _kill_when_stalled(
    command: list[str], env: dict[str, str], partial: Path, cut: int, stall: threading.Event
) -> None:
    """Run the convert `command` until `partial` holds the `cut` bytes the stalled server
    sent, then SIGKILL it (no handler runs, nothing is cleaned up) and let the server go."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while not (partial.is_file() and partial.stat().st_size == cut):
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline, "the download never reached the stall"
            time.sleep(0.02)
    finally:
        process.kill()
        process.communicate()
        stall.set()
