"""DeepSeek-V4 and its built-in DSpark draft on one NVIDIA GPU: rank files against vLLM.

    python scripts/gpu_check_deepseek_v4.py [--work DIR] [--timeout 140]

Run from the repository root with a CUDA build of vLLM 0.32 (and shardprep's
dependencies) in the interpreter. Nothing needs installing: the script writes the
`vllm.general_plugins` entry points of shardprep and of the test-only dump plugin
(`tests/vllm_dump_plugin`) into `WORK/plugins` and puts it on vLLM's PYTHONPATH.

Steps (each vLLM run is stopped once its dumps exist, and after --timeout seconds at the
latest, so the whole check stays under 5 minutes on one GPU; not run yet):

1. a tiny bfloat16 DeepSeek-V4 in the native naming with its two-stage DSpark draft
   (`make_tiny_model`), converted at tp1 x pp1;
2. vLLM with the default loader and `speculative_config={"method": "dspark"}`: the dump
   plugin saves the target's and the draft's parameters right after `load_weights`;
3. the same with `sharded-fast` (every collective trapped during the load);
4. each dump against the rank files, byte for byte: equal tensors; a parameter the family
   pads at load (`attn_sink`: 64 or 128 heads per rank with FlashMLA) holds the rank
   file's rows first, then vLLM's -inf; the draft's embedding and lm_head, which vLLM
   aliases from the target after loading, are left out.

Prints one JSON line (`{"ok": ..., "problems": [...], "seconds": {...}}`); exit status 1
when anything differs. What vLLM's CPU build cannot run is exactly this: it refuses the
DSpark method and builds no padded sink, so this is the check of the draft and of the
padding against vLLM itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
V4 = "DeepseekV4ForCausalLM"
SPECULATIVE = {"method": "dspark", "num_speculative_tokens": 3}
# Entry points of `vllm.general_plugins`: (distribution, name, object reference).
PLUGINS = (
    ("shardprep", "shardprep", "shardprep.loader.plugin:register"),
    ("shardprep_test_dump", "shardprep_test_dump", "shardprep_test_dump:register"),
)
TRAP = {"SHARDPREP_TRAP_COLLECTIVES": "1"}


def write_entry_points(folder: Path) -> Path:
    """A `*.dist-info` per plugin under `folder` with its `entry_points.txt` (what an
    installed distribution carries), so vLLM finds both plugins through PYTHONPATH."""
    for dist, name, ref in PLUGINS:
        info = folder / f"{dist}-0.0.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{name} = {ref}\n")
    return folder


def python_path(plugins: Path, existing: str = "") -> str:
    """vLLM's PYTHONPATH: the repository, the dump plugin, the entry points, then the rest."""
    parts = [str(REPO), str(REPO / "tests" / "vllm_dump_plugin"), str(plugins)]
    return os.pathsep.join(parts + ([existing] if existing else []))


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
    from shardprep.convert.run import Options, convert
    from shardprep.demo.tiny import make_tiny_model

    model = make_tiny_model(work / "model", V4)
    artifact = work / "artifact"
    convert(str(model), artifact, Options(tp=1, pp=1), progress=False)
    return model, artifact


def check(model: Path, artifact: Path, work: Path, timeout: float) -> dict[str, Any]:
    """Both vLLM runs and every comparison; the JSON summary."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import vllm_env

    from shardprep.format.manifest import read_manifest
    from shardprep.plan import archs

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
            files = rank_tensors(artifact, manifest, role, p, t)
            problems += compare_rank(
                state, files, leave_out=leave_out[role], padded=families[role].padded_at_load,
                where=f"{label} {role} pp{p} tp{t}",
            )  # fmt: skip
    return {"ok": not problems, "problems": problems, "seconds": seconds}


def rank_tensors(artifact: Path, manifest: Any, role: str, pp: int, tp: int) -> dict:
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for entry in manifest.rank_files(role, pp, tp):
        found.update(load_file(artifact / entry.path))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="a fresh temporary folder")
    parser.add_argument("--timeout", type=float, default=140.0, help="seconds per vLLM run")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-v4-"))
    started = time.monotonic()
    plugins = write_entry_points(work / "plugins")
    os.environ["PYTHONPATH"] = python_path(plugins, os.environ.get("PYTHONPATH", ""))
    os.environ.setdefault("SHARDPREP_VLLM_PYTHON", sys.executable)
    model, artifact = prepare(work)
    summary = check(model, artifact, work, args.timeout)
    summary["seconds"]["total"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
