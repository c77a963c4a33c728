"""The model card `shardprep publish` writes: Hub metadata, the source, the topology, the
size of every stage and rank, the draft, the compression, and the exact `shardprep fetch`
and `vllm serve` commands."""

from __future__ import annotations

from dataclasses import asdict

from huggingface_hub import ModelCardData

from shardprep import report
from shardprep.format import manifest as mf


def model_card(manifest: mf.Manifest, repo_id: str) -> str:
    """README.md: Hub metadata, then what the repo holds and the commands that use it."""
    target = manifest.model("target")
    topo = manifest.topology
    data = ModelCardData(
        base_model=target.source.repo_id if target and target.source.repo_id else None,
        library_name="vllm",
        pipeline_tag="text-generation",
        tags=["shardprep", "vllm", f"tp{topo.tp}", f"pp{topo.pp}"],
    )
    sections = [
        f"# {repo_id.split('/')[-1]}",
        f"Weights pre-sharded by [shardprep](https://pypi.org/project/shardprep/) "
        f"{manifest.shardprep_version} for vLLM at tensor parallel size {topo.tp} and pipeline "
        f"parallel size {topo.pp}: every (stage, rank) pair has its own safetensors files, "
        "loaded rank-locally by `--load-format sharded-fast` with no collective, and a node "
        "downloads only the stage it serves.",
        "## Source\n\n" + _source_lines(manifest),
        "## Topology\n\n" + _topology_lines(manifest),
        "## Size per stage and rank\n\n" + _size_table(manifest),
        "## Draft\n\n" + _draft_lines(manifest),
        "## Compression\n\n" + _compression_lines(manifest),
        "## Use\n\n" + _usage(manifest, repo_id),
        f"Made with shardprep {manifest.shardprep_version}; manifest format "
        f"`{manifest.format}`, vLLM parameter layout `{manifest.vllm_layout.id}` "
        f"(verified with vLLM {', '.join(manifest.vllm_layout.verified_with)}).",
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


def _source_lines(manifest: mf.Manifest) -> str:
    lines = []
    for model in manifest.models:
        source = model.source
        origin = (
            f"[{source.repo_id}](https://huggingface.co/{source.repo_id})"
            if source.repo_id
            else f"`{source.model}` (a local folder)"
        )
        revision = f" at revision `{source.revision}`" if source.revision else ""
        lines.append(
            f"- {model.role}: {origin}{revision}; {model.architecture}, {model.dtype}, "
            f"layers: {model.num_layers}"
        )
    return "\n".join(lines)


def _topology_lines(manifest: mf.Manifest) -> str:
    topo = manifest.topology
    lines = [f"- tensor parallel size {topo.tp}, pipeline parallel size {topo.pp}"]
    first = 0
    for stage, count in enumerate(topo.partition):
        lines.append(f"- stage {stage}: layers {first}-{first + count - 1} ({count} layers)")
        first += count
    lines.append(f"- stages in this repo: {', '.join(map(str, manifest.stages))}")
    lines.append(f"- serves: {manifest.served_topologies()} (`--load-format sharded-fast`)")
    lines.append(f"- serves {manifest.served_backends()}")
    for model in manifest.models:
        if model.experts is not None:
            described = report.expert_lines(asdict(model.experts), topo.tp)[0].strip()
            lines.append(f"- {model.role} {described}")
    return "\n".join(lines)


def _size_table(manifest: mf.Manifest) -> str:
    """One row per (stage, role, rank), then the stage's total: what one node downloads.
    Experts stored per dp rank have rows of their own ("1 dp 0": tp rank 1, dp rank 0)."""
    stored: dict[tuple[str, int, int, int | None], int] = {}
    for f in manifest.files:
        key = (f.role, f.pp, f.tp, f.dp)
        stored[key] = stored.get(key, 0) + (f.bytes if f.stored_bytes is None else f.stored_bytes)
    lines = [
        "| stage | role | tp rank | files | tensors | size | download |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = report.manifest_rows(manifest)
    for stage in manifest.stages:
        raw = packed = 0
        for row in (r for r in rows if r.pp == stage):
            download = stored[(row.role, row.pp, row.tp, row.dp)]
            raw, packed = raw + row.bytes, packed + download
            rank = str(row.tp) if row.dp is None else f"{row.tp} dp {row.dp}"
            lines.append(
                f"| {row.pp} | {row.role} | {rank} | {row.files} | {row.tensors} | "
                f"{report.format_bytes(row.bytes)} | {report.format_bytes(download)} |"
            )
        lines.append(
            f"| **{stage}** | **all** | | | | **{report.format_bytes(raw)}** | "
            f"**{report.format_bytes(packed)}** |"
        )
    return "\n".join(lines)


def _draft_lines(manifest: mf.Manifest) -> str:
    draft = manifest.model("draft")
    if draft is None:
        return "None: this repo holds no speculative-decoding draft."
    origin = draft.source.repo_id or draft.source.model
    last = manifest.topology.pp - 1
    return (
        f"{(draft.method or 'speculative').upper()} draft from `{origin}` ({draft.dtype}), "
        f"in `draft/`, split over the tensor parallel ranks of the last stage "
        f"({last}) only: the nodes of the other stages never download it."
    )


def _compression_lines(manifest: mf.Manifest) -> str:
    codecs = sorted({f.codec for f in manifest.files})
    if codecs == ["none"]:
        return "None: the rank files are plain safetensors."
    raw = sum(f.bytes for f in manifest.files)
    stored = sum(f.stored_bytes or f.bytes for f in manifest.files)
    return (
        f"Transport compression {', '.join(c for c in codecs if c != 'none')}: each rank file "
        f"is stored as `<path>.zst` ({report.format_bytes(stored)} to download for "
        f"{report.format_bytes(raw)} of weights, {raw / max(stored, 1):.2f}x). "
        "`shardprep fetch` checks the sha256 of both forms and undoes it into the cache, so "
        "vLLM always reads plain safetensors."
    )


def _usage(manifest: mf.Manifest, repo_id: str) -> str:
    topo = manifest.topology
    stages = " or ".join(map(str, range(topo.pp))) if topo.pp <= 2 else f"0 to {topo.pp - 1}"
    serve = (
        f'vllm serve "$MODEL" --tensor-parallel-size {topo.tp} '
        f"--pipeline-parallel-size {topo.pp} --load-format sharded-fast"
    )
    target = manifest.model("target")
    experts = target.experts if target is not None else None
    if experts is not None and experts.expert_parallel:
        serve += " --enable-expert-parallel"
        if experts.requested_placement != "linear":
            serve += f" --expert-placement-strategy {experts.requested_placement}"
    if experts is not None and experts.dp > 1:
        serve += f" --data-parallel-size {experts.dp}"
    draft = manifest.model("draft")
    if draft is not None:
        method = draft.method or "eagle3"
        config = f'{{\\"method\\": \\"{method}\\", \\"model\\": \\"$MODEL/draft\\", '
        config += '\\"num_speculative_tokens\\": 3}'
        serve += f' \\\n    --speculative-config "{config}"'
    return (
        "```bash\n"
        "pip install shardprep\n"
        f"# on each node: download only the stage it serves (STAGE = {stages}); --all for every\n"
        f"# stage; prints the local folder (under $SHARDPREP_CACHE, same path on every node)\n"
        f"MODEL=$(shardprep fetch {repo_id} --stage $STAGE --quiet)\n"
        f"{serve}\n"
        "```\n\n"
        "On several nodes, start vLLM across them as usual (Ray, or `--nnodes`/`--node-rank` "
        "with the multiprocessing backend); each node needs only the stage its GPUs serve. "
        "A node that has fetched its stage serves it with no network (`HF_HUB_OFFLINE=1`)."
    )
