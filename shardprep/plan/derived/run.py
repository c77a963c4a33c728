"""Deriving a layout: vLLM's model of every rank, built and loaded with placeholders in a
child process (probe.py) that holds one rank at a time, each rank's record read and
dropped as it comes (infer.py). The child shows a progress bar over the ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardprep.format.records import Topology
from shardprep.plan.archs.base import Layout
from shardprep.plan.derived import children
from shardprep.plan.derived.dequantized import COMPUTED, DEQUANTIZED
from shardprep.plan.derived.drafts import Speculative, split_shared, with_shared
from shardprep.plan.derived.infer import Inference
from shardprep.plan.derived.padding import built_tails


def derive(
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    topology: Topology,
    dtype: str,
    *,
    draft: str | None = None,
    progress: bool = True,
    spec: Speculative | None = None,
) -> tuple[Layout, str]:
    """The layout vLLM's own `load_weights` gives `tensors` at `topology`, every rank of
    every stage derived, and the vLLM release it came from; a write no plan can express
    is one PlanError naming it. `draft`: the speculative method of the draft to derive
    instead of the target (MTP: the draft the checkpoint carries), on the last stage.
    `spec`: a draft checkpoint of its own, whose tensors `tensors` then are (`draft`
    given), or beside which the target is derived (`draft` None)."""
    known = dict(tensors)  # and the weights vLLM dequantizes, as convert computes them
    inference = Inference(spec.config if spec and draft else config, known, topology.tp)
    shared: set[str] = set()
    shared_sources: dict[str, str] = {}
    computed: dict[str, tuple[str, str]] = {}
    with rank_records(
        config, tensors, topology, dtype, draft=draft, progress=progress, spec=spec
    ) as (version, records):
        for record in records:
            shared |= set(record.get("shared", ())) | set(record.get("may_share", ()))
            record, sources = split_shared(record)
            shared_sources |= sources
            for name, (weight, scale) in record.get("dequantized", {}).items():
                computed[name] = (weight, scale)
                known[name] = (COMPUTED, tensors[weight][1])
            inference.add(record)
    if inference.padded():
        _observe_coarser_tps(inference, config, tensors, topology, dtype, draft, spec)
    layout = inference.layout(_int(config.get("n_group")))
    layout = dataclasses.replace(layout, computed=computed)
    return with_shared(layout, shared, shared_sources), version


def _observe_coarser_tps(
    inference: Inference,
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    topology: Topology,
    dtype: str,
    draft: str | None,
    spec: Speculative | None,
) -> None:
    """The rows vLLM builds for each parameter it pads (padding.py) at every coarser tp
    the rank files may be served at, one rank of each stage apiece."""
    padded = inference.padded()
    for tp in (d for d in range(1, topology.tp) if topology.tp % d == 0):
        coarser = dataclasses.replace(topology, tp=tp)
        with rank_records(
            config, tensors, coarser, dtype, draft=draft, progress=False, tp_ranks=[0], spec=spec
        ) as (_, records):
            for record in records:
                _, tails = built_tails(record["ops"], record["params"])
                for name in padded:
                    if name in record["params"]:
                        rows = record["params"][name][1][0]
                        inference.observe_rows(name, rows - tails.get(name, 0), rows)


@contextmanager
def rank_records(
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    topology: Topology,
    dtype: str,
    *,
    draft: str | None = None,
    progress: bool = True,
    expert_placement: str | None = None,
    tp_ranks: Sequence[int] | None = None,
    spec: Speculative | None = None,
) -> Iterator[tuple[str, Iterator[dict[str, Any]]]]:
    """The vLLM release and each rank's record (probe.py), read one at a time: the
    target's on every stage, or the draft's (`draft`) on the last. `expert_placement`:
    vLLM's experts placed that way under expert parallelism; None: without it.
    `tp_ranks`: those of each stage to derive (every one by default). `spec`: a draft
    checkpoint of its own (its config.json in a folder of its own), derived or beside
    the target."""
    with tempfile.TemporaryDirectory(prefix="shardprep-derive-") as folder:
        work = Path(folder)
        (work / "model").mkdir()
        (work / "model" / "config.json").write_text(json.dumps(dict(config)))
        if spec is not None:
            (work / "draft").mkdir()
            (work / "draft" / "config.json").write_text(json.dumps(dict(spec.config)))
        stages = range(topology.pp) if draft is None else [topology.last_stage]
        ranks = [(p, t) for p in stages for t in tp_ranks or range(topology.tp)]
        request = {
            "architecture": str((config.get("architectures") or [""])[0]),
            "folder": str(work / "model"),
            "out": str(work),
            "tp": topology.tp,
            "pp": topology.pp,
            "dtype": dtype,
            "ranks": [list(rank) for rank in ranks],
            "tensors": {
                name: [d, list(shape)]
                for name, (d, shape) in tensors.items()
                if not name.endswith(DEQUANTIZED)  # convert computes them; vLLM reads none
            },
            "progress": progress,
            "draft": draft,
            "beside": spec.method if spec and draft is None else None,
            "draft_folder": str(work / "draft") if spec else None,
            "expert_placement": expert_placement,
            "env": _environment(topology),
        }
        version = children.derive(request, [list(rank) for rank in ranks])
        yield (
            version,
            (json.loads((work / f"rank-{p}-{t}.json").read_text()) for p, t in ranks),
        )


def stop() -> None:
    """Stop the deriving children now (the next derivation starts others)."""
    children.stop()


def _environment(topology: Topology) -> dict[str, str]:
    """vLLM's own reading of the partition, quiet logs, nothing fetched from a network."""
    env = dict(os.environ)
    env[children.PARTITION] = ",".join(map(str, topology.partition))
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
