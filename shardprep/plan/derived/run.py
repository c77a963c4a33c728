"""Deriving a layout: vLLM's model of every rank, built and loaded with placeholders in a
child process (probe.py) that holds one rank at a time, each rank's record read and
dropped as it comes (infer.py). The child shows a progress bar over the ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardprep.errors import PlanError, printable
from shardprep.format.records import Topology
from shardprep.plan.archs.base import Layout
from shardprep.plan.derived.drafts import split_shared, with_shared
from shardprep.plan.derived.infer import Inference


def derive(
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    topology: Topology,
    dtype: str,
    *,
    draft: str | None = None,
    progress: bool = True,
) -> tuple[Layout, str]:
    """The layout vLLM's own `load_weights` gives `tensors` at `topology`, every rank of
    every stage derived, and the vLLM release it came from; a write no plan can express
    is one PlanError naming it. `draft`: the speculative method of the draft to derive
    instead of the target (MTP: the draft the checkpoint carries), on the last stage."""
    inference = Inference(config, tensors, topology.tp)
    shared: set[str] = set()
    shared_sources: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="shardprep-derive-") as folder:
        work = Path(folder)
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(dict(config)))
        stages = range(topology.pp) if draft is None else [topology.last_stage]
        ranks = [(p, t) for p in stages for t in range(topology.tp)]
        request = {
            "architecture": str((config.get("architectures") or [""])[0]),
            "folder": str(work / "model"),
            "out": str(work),
            "tp": topology.tp,
            "pp": topology.pp,
            "dtype": dtype,
            "ranks": [list(rank) for rank in ranks],
            "tensors": {name: [d, list(shape)] for name, (d, shape) in tensors.items()},
            "progress": progress,
            "draft": draft,
        }
        done = subprocess.run(
            [sys.executable, "-m", "shardprep.plan.derived.probe"],
            input=json.dumps(request),
            stdout=subprocess.PIPE,
            text=True,
            env=_environment(topology),
            check=False,
        )
        answer = _answer(done)
        for p, t in ranks:
            record = json.loads((work / f"rank-{p}-{t}.json").read_text())
            shared |= set(record.get("shared", ()))
            record, sources = split_shared(record)
            shared_sources |= sources
            inference.add(record)
    layout = inference.layout(_int(config.get("n_group")))
    return with_shared(layout, shared, shared_sources), answer["vllm"]


def _answer(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if "error" in answer:
        raise PlanError(f"cannot derive the layout from vLLM: {printable(answer['error'], 600)}")
    if done.returncode or "vllm" not in answer:
        raise PlanError(
            f"deriving the layout from vLLM stopped (exit status {done.returncode}) before "
            "it finished; its messages are above"
        )
    return answer


def _environment(topology: Topology) -> dict[str, str]:
    """vLLM's own reading of the partition, quiet logs, nothing fetched from a network."""
    env = dict(os.environ)
    env["VLLM_PP_LAYER_PARTITION"] = ",".join(map(str, topology.partition))
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
