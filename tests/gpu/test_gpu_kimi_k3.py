"""Kimi-K3 (and its DSpark draft) on GPUs: the rank files against vLLM's own per-rank
state there.

The GPU test needs a CUDA build of vLLM 0.32 in the interpreter (or in
$SHARDPREP_VLLM_PYTHON), and tp x pp GPUs for each topology (fewer: that case skips;
no CUDA: every case skips; `-m gpu` runs them alone). Nothing needs installing: the
plugins' entry points are written into a folder on vLLM's PYTHONPATH
(tests/support/gpu_env.py). It makes what the CPU build of the test suite cannot:

- a tiny Kimi-K3 in the published naming with the published activation (`situ`, whose
  MoE the CPU build cannot run), converted at tp x pp; with the draft, a tiny DSpark
  draft in the published naming (`K3DSparkModel`, `make_tiny_draft(..., "dspark")`)
  converted with it and served with `{"method": "dspark", "model": ...,
  "num_speculative_tokens": 3}` (the case reported: tp8 x pp2 with the draft on the last
  stage);
- vLLM's default loader dumps every rank's state right after `load_weights` on the GPU
  (its GPU MLA, KDA and MoE backends; prefix caching off, `VLLM_KIMI_K3_GEMM_AR=0`), the
  draft's on the last stage too; each rank file must equal it byte for byte (the draft's
  embedding and lm_head, which vLLM aliases from the target, left out);
- `sharded-fast` with every collective refused while loading dumps the same state, and
  (the GPU build can generate) the greedy tokens of both loaders must be equal.

Not run yet: no GPU machine was at hand when it was written. The other tests, on the CPU,
prove the parts that need no GPU: the tiny Kimi-K3 and DSpark draft it prepares and
converts, the speculative configs of its two runs, and its comparison of vLLM's dumps
with the rank files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import vllm_env
from artifacts import rank_tensors
from canary import TRAP
from gpu_env import cuda_devices, python_path, write_entry_points
from safetensors.torch import load_file, save_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.format.manifest import read_manifest

KIMI = "KimiK3ForConditionalGeneration"
ENGINE = {"limit_mm_per_prompt": {"image": 1}, "enable_prefix_caching": False}
ENV = {"VLLM_KIMI_K3_GEMM_AR": "0"}
# (tp, pp, with the DSpark draft)
TOPOLOGIES = [(1, 1, False), (1, 1, True), (2, 2, True), (8, 2, True)]


def speculative(draft: Path | None) -> dict | None:
    """vLLM's speculative config for the DSpark draft in `draft` (None: no draft)."""
    if draft is None:
        return None
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}


def prepare(root: Path, tp: int, pp: int, draft: bool) -> tuple[Path, Path | None, Path]:
    """The tiny Kimi-K3 (and its DSpark draft) and their artifact at tp x pp."""
    overrides: dict = {"hidden_act": "situ", "torch_dtype": "bfloat16"}
    model = make_tiny_model(root / "model", KIMI, **overrides)
    if tp == 1:  # vLLM's own threshold (256): nothing to pad at tp 1
        config = json.loads((model / "config.json").read_text())
        del config["text_config"]["min_moe_intermediate_per_partition"]
        (model / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    folder = make_tiny_draft(root / "draft", model, "dspark") if draft else None
    artifact = root / "artifact"
    options = Options(tp=tp, pp=pp, draft=str(folder) if folder else None)
    convert(str(model), artifact, options, progress=False)
    return model, folder, artifact


def compare(artifact: Path, dumps: dict) -> list[str]:
    """Differences between each rank file and vLLM's dump of that rank (a draft's
    parameters shared with the target, which vLLM aliases after loading, left out)."""
    problems = []
    manifest = read_manifest(artifact)
    for (role, pp, tp), path in sorted(dumps.items()):
        state, _ = vllm_env.read_dump(path)
        entry = manifest.model(role)
        shared = set(entry.shared_with_target) if entry is not None else set()
        state = {name: tensor for name, tensor in state.items() if name not in shared}
        ours = rank_tensors(artifact, role, pp, tp)
        if sorted(ours) != sorted(state):
            missing, extra = sorted(set(state) - set(ours)), sorted(set(ours) - set(state))
            problems.append(f"{role} pp{pp} tp{tp}: missing {missing[:3]}, extra {extra[:3]}")
            continue
        for name, expected in state.items():
            got = ours[name]
            same = (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape))
            raw = expected.contiguous().reshape(-1).view(torch.uint8)
            if not same or not torch.equal(got.reshape(-1).view(torch.uint8), raw):
                problems.append(f"{role} pp{pp} tp{tp}: {name} differs")
    return problems


def both_loaders(root: Path, tp: int, pp: int, draft: bool) -> list[str]:
    """The tiny Kimi-K3 at tp x pp through vLLM's default loader, then `sharded-fast`
    with every collective trapped: the problems found (none when all is equal)."""
    model, folder, artifact = prepare(root, tp, pp, draft)
    run = {"dtype": "bfloat16", "engine": ENGINE, "max_tokens": 8}
    default = vllm_env.generate(
        model, tp, pp, "dump-default", dump_dir=root / "default", env=ENV,
        speculative_config=speculative(folder), **run,
    )  # fmt: skip
    dumps = vllm_env.dump_files(root / "default")
    expected = vllm_env.expected_dumps(tp, pp, with_draft=draft)
    problems = [] if set(dumps) == expected else [f"dumps {sorted(dumps)}, not {expected}"]
    problems += compare(artifact, dumps)
    fast = vllm_env.generate(
        artifact, tp, pp, "dump-sharded-fast", dump_dir=root / "fast", env=ENV | TRAP,
        speculative_config=speculative(artifact / "draft" if draft else None), **run,
    )  # fmt: skip
    fast_dumps = vllm_env.dump_files(root / "fast")
    if set(fast_dumps) != expected:
        problems.append(f"sharded-fast dumps {sorted(fast_dumps)}, not {expected}")
    for key, path in fast_dumps.items():
        _, meta = vllm_env.read_dump(path)
        if not meta.get("trap_armed") or meta.get("collective_calls"):
            problems.append(f"{key}: collectives during the load: {meta.get('collective_calls')}")
    problems += compare(artifact, fast_dumps)
    if fast != default:
        problems.append(f"tokens differ: {fast} vs {default}")
    return problems


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return prepare(tmp_path_factory.mktemp("gpu-check-k3"), 2, 2, True)


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


def test_at_tp1_it_leaves_vllms_own_expert_threshold(tmp_path: Path) -> None:
    model, draft, artifact = prepare(tmp_path, 1, 1, False)
    text = json.loads((model / "config.json").read_text())["text_config"]
    assert "min_moe_intermediate_per_partition" not in text
    assert draft is None and read_manifest(artifact).model("draft") is None


def test_its_runs_serve_the_draft_from_the_source_then_from_the_artifact(prepared: tuple) -> None:
    _, draft, artifact = prepared
    assert speculative(None) is None
    spec = speculative(draft)
    assert (spec["method"], spec["model"]) == ("dspark", str(draft))
    assert (artifact / "draft" / "config.json").is_file()


def test_its_comparison_finds_a_changed_tensor_and_leaves_out_what_vllm_aliases(
    prepared: tuple, tmp_path: Path
) -> None:
    _, _, artifact = prepared
    dump_rank_files(artifact, tmp_path / "dumps")
    dumps = vllm_env.dump_files(tmp_path / "dumps")
    assert set(dumps) == vllm_env.expected_dumps(2, 2, with_draft=True)
    assert compare(artifact, dumps) == []
    # vLLM's draft after loading may hold the target's embedding and lm_head (aliased).
    path = dumps[("draft", 1, 0)]
    state = load_file(path)
    state["model.embed_tokens.weight"] = torch.zeros(128, 64, dtype=torch.bfloat16)
    context = state["model.context_kv_proj.weight"].clone()
    context[0, 0] += 1
    state["model.context_kv_proj.weight"] = context
    save_file(state, str(path))
    assert compare(artifact, dumps) == ["draft pp1 tp0: model.context_kv_proj.weight differs"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "draft"),
    TOPOLOGIES,
    ids=[f"tp{tp}-pp{pp}" + ("-dspark" if draft else "") for tp, pp, draft in TOPOLOGIES],
)
def test_kimi_k3_rank_files_equal_vllms_state_on_gpus(
    tp: int, pp: int, draft: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cuda_devices() < tp * pp:
        pytest.skip(f"needs {tp * pp} CUDA GPUs, this machine has {cuda_devices()}")
    plugins = write_entry_points(tmp_path / "plugins")
    monkeypatch.setenv("PYTHONPATH", python_path(plugins, os.environ.get("PYTHONPATH", "")))
    monkeypatch.setenv("SHARDPREP_VLLM_PYTHON", vllm_env.vllm_python() or sys.executable)
    assert both_loaders(tmp_path, tp, pp, draft) == []
