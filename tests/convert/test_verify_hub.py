"""`verify --full` of an artifact converted from Hub repos (a target and an EAGLE-3 draft,
through the test Hub): it replays each model at the commit its manifest records, not at
the branch named, and downloads the source files the Hugging Face cache lacks (always so
after --source-budget), each checked against the sha256 the Hub states."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from stat import S_ISREG

import pytest
from hub_server import HubServer
from huggingface_hub import HfApi, try_to_load_from_cache

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model

pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/verify-target"
DRAFT = "shardprep-test/verify-eagle3"
SPLIT = "shardprep-test/verify-split"
WEIGHTS = "model.safetensors"


@pytest.fixture
def repos(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HfApi:
    """The target and its draft on the test Hub, which the client reads by default (it
    reads HF_ENDPOINT at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    template = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    model = make_tiny_model(tmp_path / "model", seed=1)
    draft = make_tiny_draft(tmp_path / "draft", model, "eagle3", seed=1)
    api = HfApi(endpoint=hub.endpoint)
    for repo, folder in ((REPO, model), (DRAFT, draft)):
        api.create_repo(repo)
        api.upload_folder(repo_id=repo, folder_path=folder)
    return api


def move_main(api: HfApi, tmp_path: Path) -> None:
    """New commits on main: the same shapes, other weights."""
    model = make_tiny_model(tmp_path / "model-2", seed=7)
    draft = make_tiny_draft(tmp_path / "draft-2", model, "eagle3", seed=7)
    for repo, folder in ((REPO, model), (DRAFT, draft)):
        api.upload_file(path_or_fileobj=folder / WEIGHTS, path_in_repo=WEIGHTS, repo_id=repo)


def verify_full(out: Path, capsys) -> str:
    capsys.readouterr()
    code = main(["verify", str(out), "--full", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    return captured.out


def test_each_model_is_replayed_at_its_recorded_commit(
    hub: HubServer, repos: HfApi, hf_client_env: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    manifest = convert(REPO, out, Options(tp=2, pp=1, draft=DRAFT), progress=False)
    commits = {m.role: m.source.revision for m in manifest.models}
    assert commits == {"target": hub.head(REPO), "draft": hub.head(DRAFT)}
    move_main(repos, tmp_path)
    assert hub.head(REPO) != commits["target"] and hub.head(DRAFT) != commits["draft"]
    # Neither commit's files in the cache any more: the replay downloads them again.
    shutil.rmtree(hf_client_env / "hub")
    assert "source tensors rebuilt byte for byte" in verify_full(out, capsys)
    for repo, role in ((REPO, "target"), (DRAFT, "draft")):
        cached = try_to_load_from_cache(repo, WEIGHTS, revision=commits[role])
        assert isinstance(cached, str), repo
        assert try_to_load_from_cache(repo, WEIGHTS, revision=hub.head(repo)) is None


def test_a_budgeted_convert_verifies_in_full(
    hub: HubServer, repos: HfApi, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    budget = 4 << 20
    convert(REPO, out, Options(tp=2, pp=1, draft=DRAFT, source_budget=budget), progress=False)
    assert try_to_load_from_cache(REPO, WEIGHTS) is None  # never in the cache
    assert "source tensors rebuilt byte for byte" in verify_full(out, capsys)
    cached = try_to_load_from_cache(REPO, WEIGHTS)
    assert isinstance(cached, str) and Path(cached).stat().st_size == hub_size(hub, REPO)


def hub_size(hub: HubServer, repo: str) -> int:
    info = HfApi(endpoint=hub.endpoint).get_paths_info(repo, [WEIGHTS])
    return info[0].size


def test_offline_a_cache_without_the_source_is_one_line(
    repos: HfApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from huggingface_hub import constants

    out = tmp_path / "out"
    manifest = convert(REPO, out, Options(tp=2, pp=1, source_budget=4 << 20), progress=False)
    commit = manifest.model("target").source.revision
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    capsys.readouterr()
    assert main(["verify", str(out), "--full", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        f"shardprep: error: HF_HUB_OFFLINE is set and the Hugging Face cache lacks {WEIGHTS} "
        f"of {REPO}@{commit[:12]}, which verify --full rebuilds the target from; unset "
        "HF_HUB_OFFLINE so that it downloads them, or download them first (`hf download "
        f"{REPO} --revision {commit}`)\n"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    verify_full(out, capsys)  # downloads them
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "source tensors rebuilt byte for byte" in verify_full(out, capsys)


def test_verify_full_within_a_source_budget(
    hub: HubServer, repos: HfApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """--source-budget: the files go to a temporary folder (TMPDIR), never more than the
    budget of them at once, each deleted once compared; the cache gets none of them."""
    model = make_tiny_model(tmp_path / "split", seed=3, files=3)
    repos.create_repo(SPLIT)
    repos.upload_folder(repo_id=SPLIT, folder_path=model)
    sizes = sorted(p.stat().st_size for p in model.glob("*.safetensors"))
    budget = sizes[-1] + sizes[0]  # never the two largest at once
    assert budget < sizes[-1] + sizes[-2]
    out = tmp_path / "out"
    convert(SPLIT, out, Options(tp=2, pp=1, source_budget=budget), progress=False)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    peaks: list[int] = []

    def watch() -> None:
        peaks.append(folder_bytes(temporary))

    report = verify(out, full=True, source_budget=budget, source_watch=watch)
    assert report.problems == [] and report.round_trip_tensors > 0
    assert peaks and sizes[-1] <= max(peaks) <= budget, peaks
    assert list(temporary.iterdir()) == []
    assert all(try_to_load_from_cache(SPLIT, p.name) is None for p in model.glob("*.safetensors"))
    capsys.readouterr()
    assert main(["verify", str(out), "--full", "--source-budget", "1kB", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--source-budget 1000 bytes is smaller than" in err, err
    assert main(["verify", str(out), "--source-budget", "1GB", "--quiet"]) == 1
    assert capsys.readouterr().err == (
        "shardprep: error: --source-budget is for `verify --full`, which reads the source\n"
    )


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (not the links to the cache)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if S_ISREG(p.lstat().st_mode))
