"""Reading a source checkpoint: config, index, safetensors headers, ranged reads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardprep.errors import ConfigError, CorruptFileError, summarize
from shardprep.safetensors_io import TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: str  # relative to the checkpoint folder
    info: TensorInfo


@dataclass(frozen=True)
class Checkpoint:
    """A model folder: its config and where every tensor's bytes lie."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, SourceTensor]
    files: tuple[str, ...]
    repo_id: str | None = None
    revision: str | None = None
    known_sha256: dict[str, str] | None = None  # from the Hub, when fetched from it
    # Tensors read from a side file rather than a safetensors file (a draft's mask
    # embedding): name -> raw bytes, described by `tensors[name]` with offset 0.
    side_tensors: dict[str, bytes] = field(default_factory=dict)

    def side_files(self) -> list[str]:
        return sorted({self.tensors[name].file for name in self.side_tensors})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: t.info.shape for name, t in self.tensors.items()}


def resolve_model(model: str, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """A local folder as it is, or a Hub repo id downloaded with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path, None, None
    if path.exists() or model.count("/") != 1 or model.startswith((".", "/")):
        raise ConfigError(f"{model} is neither a model folder nor a Hugging Face repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        local = snapshot_download(
            model, revision=revision, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]
        )
    except (HfHubHTTPError, OSError) as exc:
        raise ConfigError(f"could not download {model} from the Hugging Face Hub: {exc}") from None
    return Path(local), model, revision


def open_checkpoint(model: str, revision: str | None = None) -> Checkpoint:
    root, repo_id, revision = resolve_model(model, revision)
    config = load_config(root)
    files = _weight_files(root)
    tensors: dict[str, SourceTensor] = {}
    for file in files:
        header = read_header(root / file)
        for name, info in header.tensors.items():
            if name in tensors:
                raise CorruptFileError(
                    f"tensor {name} appears in both {tensors[name].file} and {file} of {root}; "
                    "remove the duplicate file",
                    path=str(root / file),
                )
            tensors[name] = SourceTensor(name, file, info)
    _check_index(root, tensors)
    return Checkpoint(root, config, tensors, tuple(files), repo_id, revision)


def load_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{root} has no config.json; point shardprep at a Hugging Face model folder"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return config


def _weight_files(root: Path) -> list[str]:
    index = root / INDEX_NAME
    if index.is_file():
        weight_map = _read_index(index)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise ConfigError(
                f"{index} names {summarize(missing)}, missing from {root}; "
                "download the whole checkpoint again"
            )
        return files
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{root} holds no *.safetensors files; shardprep reads safetensors checkpoints only"
        )
    return files


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"{index} has no weight_map; it is not a safetensors index") from None
    for file in weight_map.values():
        if os.path.isabs(file) or ".." in Path(file).parts:
            raise ConfigError(f"{index} names {file!r}, outside the model folder")
    return weight_map


def _check_index(root: Path, tensors: dict[str, SourceTensor]) -> None:
    index = root / INDEX_NAME
    if not index.is_file():
        return
    weight_map = _read_index(index)
    absent = [
        name
        for name, file in weight_map.items()
        if tensors.get(name) is None or tensors[name].file != file
    ]
    if absent:
        raise CorruptFileError(
            f"{index} places {summarize(absent)} in files that do not hold them; "
            "the checkpoint is inconsistent: download it again",
            path=str(index),
        )
