"""Bytes each rank reads, against its own bytes, when one artifact serves other topologies.

Converts three small models (a Llama with an EAGLE3 draft, a Qwen3-MoE, a DeepSeek-V3
with its MTP draft) at tp4 x pp2, then cuts every rank of each served topology out of it
(the loader's code, no engine) and prints, per topology, the worst and best ratio of bytes
read to the rank's own bytes (goal: 1.00) and the files a rank opens; for the models with
experts, also the most bytes one vLLM worker on a Hub repo id downloads (`worker_parts`,
with the experts as vLLM spreads them) against the whole stages it downloaded before
experts were located; and how much the recorded pieces add to the manifest.

    python scripts/bench_topologies.py
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.format.manifest import Manifest, ModelEntry, Topology, read_manifest
from shardprep.hub.cache_parts import wanted_files, worker_parts
from shardprep.hub.cache_state import Part
from shardprep.loader.regroup import ReadCount, regroup_rank
from shardprep.plan.regions import worker_stages
from shardprep.plan.topology import ExpertSplit, make_topology

TP, PP, LAYERS = 4, 2, 8
SERVED = [(4, 1), (4, 4), (2, 2), (2, 8), (1, 1), (1, 3)]
# (tp, pp, expert parallelism) for the models with experts.
SERVED_MOE = [(4, 1, False), (2, 2, False), (2, 2, True), (1, 1, False), (1, 4, False)]
MIB = 1 << 20


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
        print(f"Llama + EAGLE3: artifact tp{TP} x pp{PP}, serves {manifest.served_topologies()}")
        print(f"manifest {len(text):,} bytes, {len(bare):,} without pieces and source shapes")
        _header(hub=False)
        for tp, pp in SERVED:
            _row(artifact, manifest, tp, pp, ep=False, hub=False)

        for title, arch, config in (
            ("Qwen3-MoE", "Qwen3MoeForCausalLM", {"moe_intermediate_size": 256}),
            ("DeepSeek-V3 + MTP", "DeepseekV3ForCausalLM", {"num_nextn_predict_layers": 1}),
        ):
            model = make_tiny_model(root / arch, arch, num_hidden_layers=LAYERS, **config)
            artifact = root / f"artifact-{arch}"
            convert(str(model), artifact, Options(tp=TP, pp=PP), progress=False)
            manifest = read_manifest(artifact)
            print(f"\n{title}: artifact tp{TP} x pp{PP}, {_mib(_bytes(manifest))} MiB")
            _header(hub=True)
            for tp, pp, ep in SERVED_MOE:
                _row(artifact, manifest, tp, pp, ep=ep, hub=True)


def _header(hub: bool) -> None:
    extra = f" {'hub MiB/worker':>14} {'whole stages':>12}" if hub else ""
    print(
        f"{'served':>14} {'ranks':>5} {'read/own min':>12} {'max':>5} "
        f"{'files/rank':>10} {'s':>6}{extra}"
    )


def _row(artifact: Path, manifest: Manifest, tp: int, pp: int, ep: bool, hub: bool) -> None:
    """Every rank of tp x pp (expert parallelism `ep`), each role, cut out of `artifact`."""
    started = time.perf_counter()
    ratios, files, fetched, stages_bytes = [], [], [], []
    topo = make_topology(LAYERS, tp, pp)
    for entry in manifest.models:
        for stage in range(pp) if entry.role == "target" else (pp - 1,):
            for rank in range(tp):
                experts = None
                if entry.experts is not None:
                    split = ExpertSplit(entry.experts.num_experts, tp, 1, ep)
                    experts = (split, rank)
                count = ReadCount()
                stages = worker_stages(
                    manifest.topology, topo.partition, stage, draft=entry.role == "draft"
                )
                for _ in regroup_rank(
                    artifact, manifest, entry, _names(entry, topo, stage), tp=tp, tp_rank=rank,
                    experts=experts, count=count, stages=stages,
                ):  # fmt: skip
                    pass
                ratios.append(count.read / count.own)
                files.append(len(count.files))
                if hub:
                    partition = None if entry.role == "draft" else topo.partition
                    parts = worker_parts(
                        manifest, "org/repo", entry.role, stage, tp, rank, partition,
                        lambda _, e=experts: e,
                    )  # fmt: skip
                    fetched.append(_parts_bytes(manifest, parts))
                    whole = worker_parts(
                        manifest, "org/repo", entry.role, stage, tp, rank, partition
                    )
                    stages_bytes.append(_parts_bytes(manifest, whole))
    took = time.perf_counter() - started
    name = f"tp{tp} x pp{pp}" + (" EP" if ep else "")
    line = (
        f"{name:>14} {len(ratios):>5} {min(ratios):>12.2f} {max(ratios):>5.2f} "
        f"{max(files):>10} {took:>6.2f}"
    )
    if hub:
        line += f" {_mib(max(fetched)):>14} {_mib(max(stages_bytes)):>12}"
    print(line)


def _parts_bytes(manifest: Manifest, parts: list[Part]) -> int:
    """Rank-file bytes a fetch of `parts` downloads (the small extras left out)."""
    extras = {e.path for e in manifest.extra_files}
    return sum(w.bytes for p in parts for w in wanted_files(manifest, p) if w.path not in extras)


def _bytes(manifest: Manifest) -> int:
    return sum(f.bytes for f in manifest.files)


def _mib(size: int) -> str:
    return f"{size / MIB:.1f}"


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
