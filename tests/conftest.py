"""Shared fixtures: tiny checkpoints built once per session, caches isolated per test.

The tests mirror the package's folders; what several of them use (the Hub server, the
vLLM runner and its environment, the canary's checks of vLLM's state, hostile-file
builders, the manifest schema) is in tests/support/, importable by module name from every
test; a test module imports no other test module. tests/gpu/ holds the checks that need a
CUDA GPU (marked `gpu`, skipped without one)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from gpu_env import cuda_devices
from hub_server import HubServer

from shardprep.demo.tiny import make_tiny_draft, make_tiny_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip where this interpreter's torch sees no CUDA GPU."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and cuda_devices() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of vLLM")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("SHARDPREP_CACHE", str(tmp_path / "shardprep-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


class TinyModels:
    """Builds each tiny model on first use, under one session folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def model(self, name: str, architecture: str = "LlamaForCausalLM", **config: object) -> Path:
        if name not in self._built:
            self._built[name] = make_tiny_model(self.root / name, architecture, **config)
        return self._built[name]

    def draft(self, name: str, target: Path, method: str = "eagle3", **config: object) -> Path:
        if name not in self._built:
            self._built[name] = make_tiny_draft(self.root / name, target, method, **config)
        return self._built[name]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def hf_client_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point the real huggingface_hub client at a test Hub: caches and token under
    tmp_path, no Xet, online, no telemetry. It reads these at import, so its constants are
    patched for this process and the environment is set for subprocesses."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    frozen_at_import = {
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_OFFLINE": False,
    }
    for name, value in frozen_at_import.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_accepted_by_any_server")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return home


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    """A Hub-protocol server on 127.0.0.1 (tests/support/hub_server.py)."""
    with HubServer(tmp_path / "hub_storage") as server:
        yield server
