"""The layout contract in a real vLLM: an artifact that records the old layout string
still loads on the vLLM it names and generates what transformers does; a revision this
vLLM does not build, and substituted experts, stop the load with one line before any
rank file is opened (the rank files are gone, and the error is not about them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import vllm_env

from shardprep.convert.run import Options, convert

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
# The CPU attention backend needs a head size that is a multiple of 32.
MODEL_CONFIG = {"hidden_size": 128, "head_dim": 32}


@pytest.fixture(scope="module")
def model(tiny) -> Path:
    return tiny.model("vllm-contract-llama", **MODEL_CONFIG)


@pytest.fixture(scope="module")
def artifact(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm-contract") / "out"
    convert(str(model), out, Options(tp=1, pp=1, dtype="float32"), progress=False)
    return out


def edited(artifact: Path, where: Path, edit) -> Path:
    """A copy of the artifact whose manifest (and config) `edit` changed."""
    shutil.copytree(artifact, where)
    path = where / "shardprep.json"
    data = json.loads(path.read_text())
    edit(data, where)
    path.write_text(json.dumps(data))
    return where


def legacy(data: dict, _: Path) -> None:
    data["vllm_layout"] = "vllm-0.32/1"
    del data["request"]
    for entry in data["models"]:
        del entry["quantization"]


def test_the_old_layout_string_loads_on_vllm_032(model: Path, artifact: Path, tmp_path) -> None:
    out = edited(artifact, tmp_path / "legacy", legacy)
    tokens = vllm_env.generate(out, 1, 1, "sharded-fast", dtype="float32")
    assert tokens == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)


def revision_2(data: dict, where: Path) -> None:
    data["vllm_layout"]["revisions"]["llama"] = 2
    shutil.rmtree(where / "shards")


def no_revisions(data: dict, where: Path) -> None:
    data["vllm_layout"]["revisions"] = {}
    shutil.rmtree(where / "shards")


def substituted(data: dict, where: Path) -> None:
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "approximate_experts": True}))
    shutil.rmtree(where / "shards")


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (revision_2, "holds the llama layout revision 2 but vLLM 0.32.0"),
        (substituted, "the model config asks vLLM to substitute experts (approximate_experts)"),
        (no_revisions, "records no layout revision for llama (its target model)"),
    ],
)
def test_a_layout_vllm_does_not_build_stops_before_any_file(
    artifact: Path, tmp_path: Path, edit, line: str
) -> None:
    out = edited(artifact, tmp_path / "edited", edit)
    with pytest.raises(vllm_env.VllmRunError) as info:
        vllm_env.generate(out, 1, 1, "sharded-fast", dtype="float32", timeout=300)
    assert "LayoutMismatchError: " in str(info.value)
    assert line in str(info.value)
    assert "MissingRankFileError" not in str(info.value)
