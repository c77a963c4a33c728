"""The test Hub (tests/support/hub_server.py) driven by the real huggingface_hub client.

huggingface_hub reads HF_HUB_DISABLE_XET, HF_HUB_OFFLINE, HF_HOME/HF_HUB_CACHE, HF_TOKEN_PATH and
HF_ENDPOINT once, at import, into `huggingface_hub.constants`. Setting the environment variable
after the import changes nothing, so the autouse fixture patches both the environment (for
subprocesses) and the constants (for this process). The endpoint goes through `endpoint=`
arguments: patching `constants.ENDPOINT` alone would break `hf_hub_url`.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hub_server import HubServer, git_blob_oid
from huggingface_hub import (
    HfApi,
    constants,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils._runtime import is_xet_available

# The client's own LFS PUT passes a file object as `data=`, which httpx2 deprecates.
pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/tiny"
WEIGHTS = ("rank0/model-00001-of-00002.safetensors", "rank1/model-00002-of-00002.safetensors")
WEIGHT_BYTES = 3 * 1024 * 1024


@pytest.fixture
def api(hub: HubServer) -> HfApi:
    return HfApi(endpoint=hub.endpoint)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Small text files at the top, a few MB of binary safetensors in per-rank subfolders."""
    folder = tmp_path / "model"
    rng = random.Random(0)
    files = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "tp": 2}).encode(),
        "README.md": b"---\nlibrary_name: vllm\n---\n# tiny\n",
        "shardprep.json": b'{"format_version": 1}\n',
        **{name: rng.randbytes(WEIGHT_BYTES) for name in WEIGHTS},
    }
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture
def published(api: HfApi, model_dir: Path) -> str:
    """REPO created and `model_dir` uploaded in one commit; returns that commit id."""
    api.create_repo(REPO)
    return api.upload_folder(repo_id=REPO, folder_path=model_dir).oid


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _resolved(hub: HubServer) -> set[str]:
    """Paths of the files the client fetched (GET /resolve/) so far."""
    return {
        path.split("/resolve/", 1)[1].split("/", 1)[1]
        for m, path in hub.requests
        if m == "GET" and "/resolve/" in path
    }


def test_fixture_disables_xet() -> None:
    assert not is_xet_available()


def test_upload_folder_sends_lfs_and_inline_files(
    hub: HubServer, api: HfApi, model_dir: Path, published: str
) -> None:
    assert published == hub.head(REPO)
    puts = [path for method, path in hub.requests if method == "PUT"]
    assert len(puts) == len(WEIGHTS)  # one LFS upload per safetensors file, nothing else
    assert sum(path.endswith("/lfs/objects/verify") for _, path in hub.requests) == len(WEIGHTS)
    assert set(api.list_repo_files(REPO)) == set(_tree(model_dir)) | {".gitattributes"}

    info = api.model_info(REPO, files_metadata=True)
    assert info.sha == published
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert siblings[WEIGHTS[0]].lfs is not None
    assert siblings[WEIGHTS[0]].lfs.size == WEIGHT_BYTES
    assert siblings["config.json"].lfs is None
    assert siblings["config.json"].blob_id == git_blob_oid((model_dir / "config.json").read_bytes())


def test_tree_and_paths_info_describe_files_and_folders(api: HfApi, published: str) -> None:
    top = {entry.path: type(entry).__name__ for entry in api.list_repo_tree(REPO)}
    assert top["rank0"] == "RepoFolder"
    assert top["config.json"] == "RepoFile"
    assert WEIGHTS[0] not in top  # not recursive

    infos = api.get_paths_info(REPO, [WEIGHTS[1], "rank1", "missing.txt"], revision=published)
    assert [info.path for info in infos] == [WEIGHTS[1], "rank1"]
    assert api.file_exists(REPO, "config.json")
    assert not api.file_exists(REPO, "missing.txt")


def test_snapshot_download_fetches_only_allowed_files(
    hub: HubServer, model_dir: Path, published: str, tmp_path: Path
) -> None:
    folder = snapshot_download(
        REPO,
        allow_patterns=["rank0/*", "*.json"],
        cache_dir=tmp_path / "cache",
        endpoint=hub.endpoint,
    )
    expected = {"config.json", "shardprep.json", WEIGHTS[0]}
    assert Path(folder).name == published
    assert _resolved(hub) == expected
    assert hub.downloads(REPO, WEIGHTS[1]) == 0
    local = _tree(Path(folder))
    assert local == {name: data for name, data in _tree(model_dir).items() if name in expected}


def test_snapshot_download_to_local_dir_by_branch(
    hub: HubServer, model_dir: Path, published: str, tmp_path: Path
) -> None:
    target = tmp_path / "local"
    snapshot_download(
        REPO, revision="main", allow_patterns=["rank1/*"], local_dir=target, endpoint=hub.endpoint
    )
    assert (target / WEIGHTS[1]).read_bytes() == (model_dir / WEIGHTS[1]).read_bytes()
    assert not (target / WEIGHTS[0]).exists()


def test_hf_hub_download_uses_the_cache_the_second_time(
    hub: HubServer, model_dir: Path, published: str, tmp_path: Path
) -> None:
    def fetch() -> Path:
        path = hf_hub_download(
            REPO, WEIGHTS[0], cache_dir=tmp_path / "cache", endpoint=hub.endpoint
        )
        return Path(path)

    assert fetch().read_bytes() == (model_dir / WEIGHTS[0]).read_bytes()
    assert fetch().read_bytes() == (model_dir / WEIGHTS[0]).read_bytes()
    assert hub.downloads(REPO, WEIGHTS[0]) == 1  # the second call only sent a HEAD


def test_second_commit_keeps_both_revisions_downloadable(
    hub: HubServer, api: HfApi, model_dir: Path, published: str, tmp_path: Path
) -> None:
    old_config = (model_dir / "config.json").read_bytes()
    (model_dir / "config.json").write_text('{"changed": true}')
    (model_dir / "extra.txt").write_text("new file\n")
    second = api.upload_folder(repo_id=REPO, folder_path=model_dir, commit_message="second").oid

    assert second != published
    assert hub.head(REPO) == second
    assert [m for m, p in hub.requests if m == "PUT"] == ["PUT"] * len(WEIGHTS)  # no re-upload
    for revision, config in ((published, old_config), (second, b'{"changed": true}')):
        path = hf_hub_download(
            REPO, "config.json", revision=revision, cache_dir=tmp_path / "c", endpoint=hub.endpoint
        )
        assert Path(path).read_bytes() == config
    assert "extra.txt" not in api.list_repo_files(REPO, revision=published)
    assert api.repo_info(REPO, revision=published).sha == published


def test_missing_repo_revision_and_file_raise_typed_errors(
    hub: HubServer, api: HfApi, published: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("shardprep-test/missing", cache_dir=cache, endpoint=hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(
            "shardprep-test/missing", "config.json", cache_dir=cache, endpoint=hub.endpoint
        )
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("shardprep-test/missing")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="f" * 40, cache_dir=cache, endpoint=hub.endpoint)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.bin", cache_dir=cache, endpoint=hub.endpoint)


def test_cut_inside_the_first_chunk_restarts_from_zero(
    hub: HubServer, model_dir: Path, published: str, tmp_path: Path
) -> None:
    """`http_get` retries a dropped connection (RemoteProtocolError) after 1 s, up to 5 times.

    It resumes from the bytes already written, and it writes in DOWNLOAD_CHUNK_SIZE (10 MiB)
    pieces: a cut before the first 10 MiB loses everything, the retry has no Range header.
    """
    hub.cut_next_download(REPO, WEIGHTS[0], after_bytes=1_000_000)
    folder = snapshot_download(
        REPO, allow_patterns=[WEIGHTS[0]], cache_dir=tmp_path / "cache", endpoint=hub.endpoint
    )
    assert (Path(folder) / WEIGHTS[0]).read_bytes() == (model_dir / WEIGHTS[0]).read_bytes()
    assert hub.download_ranges(REPO, WEIGHTS[0]) == [None, None]


def test_cut_after_a_full_chunk_resumes_with_a_range(
    hub: HubServer, api: HfApi, published: str, tmp_path: Path
) -> None:
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = random.Random(1).randbytes(chunk + 2 * 1024 * 1024)
    api.upload_file(repo_id=REPO, path_or_fileobj=data, path_in_repo="big/model.safetensors")
    hub.cut_next_download(REPO, "big/model.safetensors", after_bytes=chunk + 1024 * 1024)
    path = hf_hub_download(
        REPO, "big/model.safetensors", cache_dir=tmp_path / "cache", endpoint=hub.endpoint
    )
    assert Path(path).read_bytes() == data
    assert hub.download_ranges(REPO, "big/model.safetensors") == [None, f"bytes={chunk}-"]


def test_corrupt_blob_is_served_and_not_detected_by_the_download(
    hub: HubServer, api: HfApi, model_dir: Path, published: str, tmp_path: Path
) -> None:
    """The plain-HTTP download never hashes what it received: only verify_repo_checksums sees it."""
    hub.corrupt_blob(REPO, WEIGHTS[1])
    cache = tmp_path / "cache"
    folder = Path(
        snapshot_download(REPO, allow_patterns=["rank1/*"], cache_dir=cache, endpoint=hub.endpoint)
    )
    received, original = (folder / WEIGHTS[1]).read_bytes(), (model_dir / WEIGHTS[1]).read_bytes()
    assert len(received) == len(original)
    assert received != original

    report = api.verify_repo_checksums(REPO, revision=published, cache_dir=cache)
    assert [(m["path"], m["algorithm"]) for m in report.mismatches] == [(WEIGHTS[1], "sha256")]


def _open(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method, headers=headers)
    with urllib.request.urlopen(request) as response:
        return response.status, dict(response.headers), response.read()


def test_range_and_head_answers_on_the_wire(hub: HubServer, published: str) -> None:
    url = f"{hub.endpoint}/{REPO}/resolve/main/{WEIGHTS[0]}"
    status, head, body = _open(url, "HEAD")
    assert (status, body) == (200, b"")
    assert head["X-Repo-Commit"] == published
    assert head["X-Linked-Size"] == head["Content-Length"] == str(WEIGHT_BYTES)
    assert head["ETag"] == head["X-Linked-Etag"]

    status, part, body = _open(url, Range="bytes=10-19")
    assert (status, part["Content-Range"], len(body)) == (206, f"bytes 10-19/{WEIGHT_BYTES}", 10)

    with pytest.raises(urllib.error.HTTPError) as err:
        _open(url, Range=f"bytes={WEIGHT_BYTES}-")
    assert err.value.code == 416
    err.value.close()


def test_repos_survive_a_restart_and_the_tree_paginates(
    hub: HubServer, published: str, tmp_path: Path
) -> None:
    hub.stop()
    with HubServer(tmp_path / "hub_storage", tree_page_size=2) as again:
        files = HfApi(endpoint=again.endpoint).list_repo_files(REPO)
        assert len(files) == 6
        # 6 files and 2 folders in pages of 2: the client followed the Link header 3 times
        assert sum("/tree/" in path for _, path in again.requests) == 4
