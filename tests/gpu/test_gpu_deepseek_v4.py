"""DeepSeek-V4 and its built-in DSpark draft on one NVIDIA GPU: rank files against vLLM.

What vLLM's CPU build cannot run is exactly this: it refuses the DSpark method and builds
no padded sink, so the GPU test is the check of the draft and of the padding against vLLM
itself. It needs a CUDA build of vLLM 0.32 in the interpreter (or in
$SHARDPREP_VLLM_PYTHON) and skips without a CUDA GPU (`-m gpu` runs it alone); nothing
needs installing: the plugins' entry points are written into a folder on vLLM's
PYTHONPATH (tests/support/gpu_env.py). Its steps, each vLLM run stopped once its dumps
exist and after TIMEOUT seconds at the latest (under 5 minutes on one GPU; not run yet):

1. a tiny bfloat16 DeepSeek-V4 in the native naming with its two-stage DSpark draft
   (`make_tiny_model`), converted at tp1 x pp1;
2. vLLM with the default loader and `speculative_config={"method": "dspark"}`: the dump
   plugin saves the target's and the draft's parameters right after `load_weights`;
3. the same with `sharded-fast` (every collective trapped during the load);
4. each dump against the rank files, byte for byte: equal tensors; a parameter the family
   pads at load (`attn_sink`: 64 or 128 heads per rank with FlashMLA) holds the rank
   file's rows first, then vLLM's -inf; the draft's embedding and lm_head, which vLLM
   aliases from the target after loading, are left out.

The other tests, on the CPU, prove the parts of that check that need no GPU: the
comparison, the plugin entry points and the tiny checkpoint and artifact.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_env
from artifacts import rank_tensors
from canary import TRAP
from gpu_env import REPO, python_path, write_entry_points
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import read_manifest
from shardprep.plan import archs

V4 = "DeepseekV4ForCausalLM"
SPECULATIVE = {"method": "dspark", "num_speculative_tokens": 3}
TIMEOUT = 140.0  # seconds per vLLM run
SINK = "model.layers.0.attn.attn_sink"


def compare_rank(
    dumped: Mapping[str, torch.Tensor],
    files: Mapping[str, torch.Tensor],
    *,
    leave_out: set[str],
    padded: Callable[[str], bool],
    where: str,
) -> list[str]:
    """Problems between vLLM's state of one rank (`dumped`) and the rank's files, each a
    line naming the parameter; none when they are equal byte for byte (a padded parameter:
    the file's rows first, then -inf, as vLLM initializes a DeepSeek-V4 sink)."""
    problems = []
    names = (set(dumped) | set(files)) - leave_out
    for name in sorted(names):
        built, stored = dumped.get(name), files.get(name)
        if built is None or stored is None:
            side = "the rank files" if stored is None else "vLLM's state"
            problems.append(f"{where}: {name} is missing from {side}")
            continue
        if built.dtype != stored.dtype:
            problems.append(
                f"{where}: {name} is {stored.dtype} in the files, {built.dtype} in vLLM"
            )
            continue
        front = built
        if tuple(built.shape) != tuple(stored.shape):
            if not (padded(name) and _fits(tuple(stored.shape), tuple(built.shape))):
                problems.append(
                    f"{where}: {name} is {tuple(stored.shape)} in the files, "
                    f"{tuple(built.shape)} in vLLM"
                )
                continue
            front, rest = built[: stored.shape[0]], built[stored.shape[0] :]
            if not bool(torch.all(rest == -float("inf"))):
                problems.append(f"{where}: {name}'s padding is not -inf in vLLM")
        if not torch.equal(_raw(front), _raw(stored)):
            problems.append(f"{where}: {name} differs")
    return problems


def _fits(stored: tuple[int, ...], built: tuple[int, ...]) -> bool:
    return len(stored) == len(built) >= 1 and stored[1:] == built[1:] and stored[0] <= built[0]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def prepare(work: Path) -> tuple[Path, Path]:
    """The tiny DeepSeek-V4 with its DSpark draft, and its tp1 x pp1 artifact."""
    model = make_tiny_model(work / "model", V4)
    artifact = work / "artifact"
    convert(str(model), artifact, Options(tp=1, pp=1), progress=False)
    return model, artifact


def check(model: Path, artifact: Path, work: Path, timeout: float) -> dict[str, Any]:
    """Both vLLM runs and every comparison; the JSON summary."""
    manifest = read_manifest(artifact)
    draft = manifest.model("draft")
    assert draft is not None, "the artifact has no DSpark draft"
    families = {
        "target": archs.target_family_of(V4),
        "draft": archs.draft_family("dspark", "deepseek_v4"),
    }
    leave_out = {"target": set(), "draft": set(draft.shared_with_target)}
    run = {"dtype": "bfloat16", "speculative_config": SPECULATIVE, "allow_engine_failure": True}
    seconds, problems = {}, []
    dumps = {}
    for label, folder, extra in (
        ("default", model, {}),
        ("sharded-fast", artifact, {"load_format": "dump-sharded-fast", "env": TRAP}),
    ):
        started = time.monotonic()
        dumps[label] = vllm_env.dump_state(
            folder, 1, 1, work / label, timeout=timeout, **run, **extra
        )
        seconds[label] = round(time.monotonic() - started, 1)
    for label, found in dumps.items():
        expected = vllm_env.expected_dumps(1, 1, with_draft=True)
        if set(found) != expected:
            problems.append(f"{label}: dumps {sorted(found)}, expected {sorted(expected)}")
        for (role, p, t), path in sorted(found.items()):
            state, meta = vllm_env.read_dump(path)
            if label == "sharded-fast" and (
                meta.get("collective_calls") or not meta.get("trap_armed")
            ):
                problems.append(f"{label} {role}: collectives during the load: {meta}")
            files = rank_tensors(artifact, role, p, t)
            problems += compare_rank(
                state, files, leave_out=leave_out[role], padded=families[role].padded_at_load,
                where=f"{label} {role} pp{p} tp{t}",
            )  # fmt: skip
    return {"ok": not problems, "problems": problems, "seconds": seconds}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return prepare(tmp_path_factory.mktemp("gpu-check"))


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


def compare(state: dict, files: dict) -> list[str]:
    return compare_rank(
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
    files = rank_tensors(artifact, "draft", 0, 0)
    assert files["model.layers.0.attn.attn_sink"].shape == (4,)  # every head at tp1
    assert any(n.startswith("mtp.") for n in load_file(model / "model.safetensors"))


def test_a_padded_state_equal_to_the_files_passes(prepared: tuple[Path, Path]) -> None:
    files = rank_tensors(prepared[1], "draft", 0, 0)
    assert compare(gpu_state(files, 64), files) == []


def test_every_difference_is_named(prepared: tuple[Path, Path]) -> None:
    files = rank_tensors(prepared[1], "draft", 0, 0)
    state = gpu_state(files, 64)
    state["model.main_norm.weight"] = state["model.main_norm.weight"].clone()
    state["model.main_norm.weight"][3] += 1  # one value
    state["model.layers.1.attn.attn_sink"][10] = 0.0  # padding vLLM did not leave at -inf
    state["model.layers.0.attn.wq_b.weight"] = state["model.layers.0.attn.wq_b.weight"][:8]
    del state["model.context_wkv_proj.weight"]
    state["model.extra"] = torch.zeros(1)
    assert compare(state, files) == [
        "draft: model.context_wkv_proj.weight is missing from vLLM's state",
        "draft: model.extra is missing from the rank files",
        "draft: model.layers.0.attn.wq_b.weight is (2048, 64) in the files, (8, 64) in vLLM",
        "draft: model.layers.1.attn.attn_sink's padding is not -inf in vLLM",
        "draft: model.main_norm.weight differs",
    ]
    state = gpu_state(files, 64)
    state[SINK][1] = 7.0  # one of the rank's own heads
    assert compare(state, files) == [f"draft: {SINK} differs"]


def test_the_entry_points_are_the_plugins_own(tmp_path: Path) -> None:
    folder = write_entry_points(tmp_path / "plugins")
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
    path = python_path(folder, "/elsewhere")
    assert path.split(":")[-1] == "/elsewhere" and str(folder) in path.split(":")


@pytest.mark.gpu
@pytest.mark.slow
def test_deepseek_v4_and_its_dspark_draft_equal_vllms_state_on_a_gpu(
    prepared: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins = write_entry_points(tmp_path / "plugins")
    monkeypatch.setenv("PYTHONPATH", python_path(plugins, os.environ.get("PYTHONPATH", "")))
    monkeypatch.setenv("SHARDPREP_VLLM_PYTHON", vllm_env.vllm_python() or sys.executable)
    started = time.monotonic()
    summary = check(*prepared, tmp_path, TIMEOUT)
    summary["seconds"]["total"] = round(time.monotonic() - started, 1)
    assert summary["ok"] and summary["problems"] == [], summary
