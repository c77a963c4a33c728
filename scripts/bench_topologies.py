"""Bytes each rank reads, against its own bytes, when one artifact serves other topologies.

Converts a small Llama with an EAGLE3 draft at tp4 x pp2, then cuts every rank of each
served topology out of it (the loader's code, no engine) and prints, per topology, the
worst and best ratio of bytes read to the rank's own bytes (goal: 1.00) and the files a
rank opens; also how much the recorded pieces add to the manifest.

    python scripts/bench_topologies.py
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.format.manifest import ModelEntry, Topology, read_manifest
from shardprep.loader.regroup import ReadCount, regroup_rank
from shardprep.plan.regions import worker_stages
from shardprep.plan.topology import make_topology

TP, PP, LAYERS = 4, 2, 8
SERVED = [(4, 1), (4, 4), (2, 2), (2, 8), (1, 1), (1, 3)]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "llama", num_hidden_layers=LAYERS, hidden_size=512,
                                intermediate_size=1536, num_attention_heads=8)  # fmt: skip
        draft = make_tiny_draft(root / "eagle3", model)
        artifact = root / "artifact"
        convert(str(model), artifact, Options(tp=TP, pp=PP, draft=str(draft)), progress=False)
        manifest = read_manifest(artifact)
        text = (artifact / "shardprep.json").read_text()
        bare = dataclasses.replace(
            manifest,
            models=tuple(
                dataclasses.replace(m, pieces={}, source_shapes={}) for m in manifest.models
            ),
        ).to_json()
        print(f"artifact tp{TP} x pp{PP}, serves {manifest.served_topologies()}")
        print(f"manifest {len(text):,} bytes, {len(bare):,} without pieces and source shapes")
        print(
            f"{'served':>10} {'ranks':>5} {'read/own min':>12} {'max':>5} "
            f"{'files/rank':>10} {'s':>6}"
        )
        for tp, pp in SERVED:
            started = time.perf_counter()
            ratios, files = [], []
            topo = make_topology(LAYERS, tp, pp)
            for role in ("target", "draft"):
                entry = manifest.model(role)
                assert entry is not None
                for stage in range(pp) if role == "target" else (pp - 1,):
                    for rank in range(tp):
                        wanted = _names(entry, topo, stage)
                        count = ReadCount()
                        stages = worker_stages(
                            manifest.topology, topo.partition, stage, draft=role == "draft"
                        )
                        for _ in regroup_rank(
                            artifact, manifest, entry, wanted, tp=tp, tp_rank=rank, count=count,
                            stages=stages,
                        ):  # fmt: skip
                            pass
                        ratios.append(count.read / count.own)
                        files.append(len(count.files))
            took = time.perf_counter() - started
            print(f"{f'tp{tp} x pp{pp}':>10} {len(ratios):>5} {min(ratios):>12.2f} "
                  f"{max(ratios):>5.2f} {max(files):>10} {took:>6.2f}")  # fmt: skip


def _names(entry: ModelEntry, topo: Topology, stage: int) -> list[str]:
    """The parameters a rank of `topo` on `stage` holds: the layers of its range, and
    what is not a layer (embedding, norm, head) where the plan puts it."""
    start, end = topo.layer_range(stage)
    names = []
    for name in entry.pieces:
        parts = name.split(".")
        if "layers" in parts:
            layer = int(parts[parts.index("layers") + 1])
            if entry.role == "draft" or start <= layer < end:
                names.append(name)
        elif entry.role == "draft" or ("embed" in name) == (stage == 0) or stage == topo.pp - 1:
            names.append(name)
    return names


if __name__ == "__main__":
    main()
