"""A tiny model whose stages live in different files, served by the test Hub as a repo
id: embeddings and layers 0-1 in the first, layers 2-3 in the second, the final norm and
lm_head in the third, so stage 1 of pp=2 needs the second and third only. The fixtures
`model` and `repo`, and what the tests of a Hub source ask of the server."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from hub_server import HubServer
from huggingface_hub import HfApi
from safetensors.torch import load_file, save_file

from shardprep.convert.run import Options
from shardprep.demo.tiny import make_tiny_model

REPO = "shardprep-test/by-stage"
DRAFT = "shardprep-test/by-stage-eagle3"
FIRST, SECOND, THIRD = (f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3))
WEIGHTS = (FIRST, SECOND, THIRD)
HEADER_LIMIT = 4096  # bytes of a file `plan` may read: its header, nothing of its tensors


def file_of_stage(name: str) -> str:
    if name.startswith("model.layers."):
        return FIRST if int(name.split(".")[2]) < 2 else SECOND
    return FIRST if "embed_tokens" in name else THIRD


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("by-stage") / "model", torch_dtype="bfloat16")
    return split_by_stage(folder)


def split_by_stage(folder: Path, file_of: Callable[[str], str] = file_of_stage) -> Path:
    """The model's one safetensors file rewritten as FIRST, SECOND and THIRD (`file_of`)."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    weight_map = {name: file_of(name) for name in sorted(tensors)}
    for file in WEIGHTS:
        part = {n: t for n, t in tensors.items() if weight_map[n] == file}
        save_file(part, folder / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture
def repo(hub: HubServer, model: Path) -> str:
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=model)
    return hub.head(REPO)


def hub_options(hub: HubServer, **more: object) -> Options:
    return Options(tp=2, pp=2, endpoint=hub.endpoint, **more)  # type: ignore[arg-type]


def stage_shards(out: Path, stage: int) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").glob(f"model-pp-{stage}-*"))}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def body_ranges(hub: HubServer, file: str, repo: str = REPO) -> list[str | None]:
    """The Range header of each GET of `file` for its body (not a header read)."""
    return [r for r in hub.download_ranges(repo, file) if r is None or r.endswith("-")]


def files_fetched(hub: HubServer, repo: str, weights: Iterable[str]) -> set[str]:
    """The weight files of `repo` whose body was asked for (not only their header)."""
    return {f for f in weights if body_ranges(hub, f, repo)}
