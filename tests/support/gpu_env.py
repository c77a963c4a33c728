"""What a GPU check needs of the machine: a CUDA GPU count, and the `vllm.general_plugins`
entry points of shardprep and of the test-only dump plugin (`tests/vllm_dump_plugin`) on
vLLM's PYTHONPATH, so that nothing needs installing besides a CUDA build of vLLM."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Entry points of `vllm.general_plugins`: (distribution, name, object reference).
PLUGINS = (
    ("shardprep", "shardprep", "shardprep.loader.plugin:register"),
    ("shardprep_test_dump", "shardprep_test_dump", "shardprep_test_dump:register"),
)


def cuda_devices() -> int:
    """How many CUDA GPUs this interpreter's torch sees (none without a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
