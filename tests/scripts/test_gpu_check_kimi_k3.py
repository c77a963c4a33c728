"""The parts of `scripts/gpu_check_kimi_k3.py` that need no GPU: the tiny Kimi-K3 and
DSpark draft it prepares and converts, the speculative configs of its two runs, and the
comparison it makes between vLLM's dumps and the rank files. (The vLLM runs themselves
need a CUDA vLLM: the CPU build refuses the DSpark method and cannot run the `situ` MoE.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardprep.format.manifest import read_manifest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    path = REPO / "scripts" / "gpu_check_kimi_k3.py"
    spec = importlib.util.spec_from_file_location("gpu_check_kimi_k3", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prepared(script: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return script.prepare(tmp_path_factory.mktemp("gpu-check-k3"), 2, 2, True)


def dump_rank_files(artifact: Path, folder: Path) -> None:
    """Each rank's files written as the dump plugin writes vLLM's state."""
    manifest = read_manifest(artifact)
    folder.mkdir()
    for role, pp, tp in sorted({(f.role, f.pp, f.tp) for f in manifest.files}):
        state: dict[str, torch.Tensor] = {}
        for entry in manifest.rank_files(role, pp, tp):
            state.update(load_file(artifact / entry.path))
        meta = {"trap_armed": json.dumps(True)}
        save_file(state, str(folder / f"{role}-pp{pp}-tp{tp}.safetensors"), metadata=meta)


def test_it_prepares_kimi_k3_with_its_dspark_draft_in_the_published_naming(
    prepared: tuple,
) -> None:
    model, draft, artifact = prepared
    config = json.loads((model / "config.json").read_text())
    assert config["text_config"]["hidden_act"] == "situ"
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["K3DSparkModel"]
    names = set(load_file(draft / "model.safetensors"))
    assert "layers.1.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names  # as published
    manifest = read_manifest(artifact)
    assert [(m.role, m.method) for m in manifest.models] == [("target", None), ("draft", "dspark")]
    assert {(f.pp, f.tp) for f in manifest.files if f.role == "draft"} == {(1, 0), (1, 1)}


def test_at_tp1_it_leaves_vllms_own_expert_threshold(script: ModuleType, tmp_path: Path) -> None:
    model, draft, artifact = script.prepare(tmp_path, 1, 1, False)
    text = json.loads((model / "config.json").read_text())["text_config"]
    assert "min_moe_intermediate_per_partition" not in text
    assert draft is None and read_manifest(artifact).model("draft") is None


def test_its_runs_serve_the_draft_from_the_source_then_from_the_artifact(
    script: ModuleType, prepared: tuple
) -> None:
    _, draft, artifact = prepared
    assert script.speculative(None) is None
    spec = script.speculative(draft)
    assert (spec["method"], spec["model"]) == ("dspark", str(draft))
    assert (artifact / "draft" / "config.json").is_file()


def test_its_comparison_finds_a_changed_tensor_and_leaves_out_what_vllm_aliases(
    script: ModuleType, prepared: tuple, tmp_path: Path
) -> None:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import vllm_env

    _, _, artifact = prepared
    dump_rank_files(artifact, tmp_path / "dumps")
    dumps = vllm_env.dump_files(tmp_path / "dumps")
    assert set(dumps) == vllm_env.expected_dumps(2, 2, with_draft=True)
    assert script.compare(artifact, dumps) == []
    # vLLM's draft after loading may hold the target's embedding and lm_head (aliased).
    path = dumps[("draft", 1, 0)]
    state = load_file(path)
    state["model.embed_tokens.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    context = state["model.context_kv_proj.weight"].clone()
    context[0, 0] += 1
    state["model.context_kv_proj.weight"] = context
    save_file(state, str(path))
    assert script.compare(artifact, dumps) == [
        "draft pp1 tp0: model.context_kv_proj.weight differs"
    ]
