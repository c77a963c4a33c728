"""Shared fixtures: tiny checkpoints built once per session, caches isolated per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardprep.tiny import make_tiny_draft, make_tiny_model


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
