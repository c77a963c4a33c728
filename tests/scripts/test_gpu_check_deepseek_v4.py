"""The parts of `scripts/gpu_check_deepseek_v4.py` that need no GPU: the comparison it
makes between vLLM's state and the rank files, the plugin entry points it writes, and
the tiny checkpoint and artifact it prepares. (The vLLM runs themselves need a CUDA vLLM:
the CPU build refuses the DSpark method.)"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from shardprep.format.manifest import read_manifest
from shardprep.plan import archs

REPO = Path(__file__).resolve().parents[2]
SINK = "model.layers.0.attn.attn_sink"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    path = REPO / "scripts" / "gpu_check_deepseek_v4.py"
    spec = importlib.util.spec_from_file_location("gpu_check_deepseek_v4", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prepared(script: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return script.prepare(tmp_path_factory.mktemp("gpu-check"))


def draft_rank(artifact: Path) -> dict[str, torch.Tensor]:
    manifest = read_manifest(artifact)
    found: dict[str, torch.Tensor] = {}
    for entry in manifest.rank_files("draft", 0, 0):
        found.update(load_file(artifact / entry.path))
    return found


def gpu_state(files: dict[str, torch.Tensor], padded_heads: int) -> dict[str, torch.Tensor]:
    """What vLLM's NVIDIA build leaves on the rank, as its loader fills it: the sinks
    padded with -inf to `padded_heads`, the aliased embedding and lm_head uninitialized."""
    state = {n: t.clone() for n, t in files.items()}
    for name, tensor in files.items():
        if name.endswith(".attn.attn_sink"):
            sink = torch.full((padded_heads,), -float("inf"), dtype=torch.float32)
            sink[: tensor.shape[0]] = tensor
            state[name] = sink
    state["model.embed_tokens.weight"] = torch.empty(1000, 256, dtype=torch.bfloat16)
    state["lm_head.weight"] = torch.empty(1000, 256, dtype=torch.bfloat16)
    return state


def compare(script: ModuleType, state: dict, files: dict) -> list[str]:
    return script.compare_rank(
        state, files, leave_out={"model.embed_tokens.weight", "lm_head.weight"},
        padded=archs.draft_family("dspark", "deepseek_v4").padded_at_load, where="draft",
    )  # fmt: skip


def test_the_prepared_artifact_holds_the_target_and_its_draft_at_tp1(
    prepared: tuple[Path, Path],
) -> None:
    model, artifact = prepared
    manifest = read_manifest(artifact)
    assert [(m.role, m.method) for m in manifest.models] == [("target", None), ("draft", "dspark")]
    assert (manifest.topology.tp, manifest.topology.pp) == (1, 1)
    files = draft_rank(artifact)
    assert files["model.layers.0.attn.attn_sink"].shape == (4,)  # every head at tp1
    assert any(n.startswith("mtp.") for n in load_file(model / "model.safetensors"))


def test_a_padded_state_equal_to_the_files_passes(
    script: ModuleType, prepared: tuple[Path, Path]
) -> None:
    files = draft_rank(prepared[1])
    assert compare(script, gpu_state(files, 64), files) == []


def test_every_difference_is_named(script: ModuleType, prepared: tuple[Path, Path]) -> None:
    files = draft_rank(prepared[1])
    state = gpu_state(files, 64)
    state["model.main_norm.weight"] = state["model.main_norm.weight"].clone()
    state["model.main_norm.weight"][3] += 1  # one value
    state["model.layers.1.attn.attn_sink"][10] = 0.0  # padding vLLM did not leave at -inf
    state["model.layers.0.attn.wq_b.weight"] = state["model.layers.0.attn.wq_b.weight"][:8]
    del state["model.context_wkv_proj.weight"]
    state["model.extra"] = torch.zeros(1)
    assert compare(script, state, files) == [
        "draft: model.context_wkv_proj.weight is missing from vLLM's state",
        "draft: model.extra is missing from the rank files",
        "draft: model.layers.0.attn.wq_b.weight is (2048, 64) in the files, (8, 64) in vLLM",
        "draft: model.layers.1.attn.attn_sink's padding is not -inf in vLLM",
        "draft: model.main_norm.weight differs",
    ]
    state = gpu_state(files, 64)
    state[SINK][1] = 7.0  # one of the rank's own heads
    assert compare(script, state, files) == [f"draft: {SINK} differs"]


def test_the_entry_points_are_the_plugins_own(script: ModuleType, tmp_path: Path) -> None:
    folder = script.write_entry_points(tmp_path / "plugins")
    found = {
        e.name: e.value
        for dist in importlib.metadata.distributions(path=[str(folder)])
        for e in dist.entry_points
        if e.group == "vllm.general_plugins"
    }
    expected = {}
    for pyproject in (REPO / "pyproject.toml", REPO / "tests/vllm_dump_plugin/pyproject.toml"):
        section = pyproject.read_text().split('[project.entry-points."vllm.general_plugins"]')[1]
        expected |= dict(re.findall(r'^(\w+) = "([\w.:]+)"$', section.split("\n[")[0], re.M))
    assert found == expected and len(expected) == 2
    path = script.python_path(folder, "/elsewhere")
    assert path.split(":")[-1] == "/elsewhere" and str(folder) in path.split(":")
