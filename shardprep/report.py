"""Per-stage, per-rank summaries of a plan or an artifact, as rows and as text."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from shardprep.format import manifest as mf
from shardprep.format.headers import encode_header
from shardprep.plan.quant import param_suffixes
from shardprep.plan.records import ExpertPlan, FilePlan, ModelPlan, Plan

LAYER_INDEX = re.compile(r"\.\d+\.")


@dataclass(frozen=True)
class RankRow:
    role: str
    pp: int
    tp: int
    files: int
    tensors: int
    bytes: int
    dp: int | None = None  # the experts of this dp rank; None: what every dp rank reads


Key = tuple[str, int, int, "int | None"]


def plan_rows(plan: Plan) -> list[RankRow]:
    rows: dict[Key, list[int]] = {}
    for file in plan.files:
        counts = rows.setdefault((file.role, file.pp, file.tp, file.dp), [0, 0, 0])
        counts[0] += 1
        counts[1] += len(file.tensors)
        counts[2] += file_bytes(file)
    return [_row(key, counts) for key, counts in sorted(rows.items(), key=_order)]


def _row(key: Key, counts: list[int]) -> RankRow:
    role, pp, tp, dp = key
    files, tensors, size = counts
    return RankRow(role, pp, tp, files, tensors, size, dp)


def file_bytes(file: FilePlan) -> int:
    """The size the rank file will have on disk, header included (as the manifest says)."""
    return len(encode_header([t.spec for t in file.tensors], {"format": "pt"})) + file.nbytes


def manifest_rows(manifest: mf.Manifest) -> list[RankRow]:
    rows: dict[Key, list[int]] = {}
    for file in manifest.files:
        counts = rows.setdefault((file.role, file.pp, file.tp, file.dp), [0, 0, 0])
        counts[0] += 1
        counts[2] += file.bytes
    for model in manifest.models:
        for key, params in model.ranks.items():
            row = (model.role, *mf.split_rank_key(key))
            if row in rows:
                rows[row][1] = len(params)
    return [_row(key, counts) for key, counts in sorted(rows.items(), key=_order)]


def _order(item: tuple[Key, list[int]]) -> tuple[int, bool, int, int]:
    (role, pp, tp, dp), _ = item
    return (pp, role != "target", tp, -1 if dp is None else dp)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def table(rows: list[RankRow]) -> str:
    """One line per rank; with experts stored per dp rank, a dp column says whose they are
    ("all": the rank's shared files, read by every dp rank)."""
    with_dp = any(r.dp is not None for r in rows)

    def dp(text: str) -> str:
        return f"  {text:>3}" if with_dp else ""

    lines = [
        f"{'stage':>5}  {'role':<6}  {'tp':>3}{dp('dp')}  {'files':>5}  {'tensors':>7}  "
        f"{'size':>10}"
    ]
    for row in rows:
        lines.append(
            f"{row.pp:>5}  {row.role:<6}  {row.tp:>3}{dp('all' if row.dp is None else str(row.dp))}"
            f"  {row.files:>5}  {row.tensors:>7}  {format_bytes(row.bytes):>10}"
        )
    total = sum(r.bytes for r in rows)
    lines.append(
        f"{'':>5}  {'total':<6}  {'':>3}{dp('')}  {sum(r.files for r in rows):>5}  "
        f"{sum(r.tensors for r in rows):>7}  {format_bytes(total):>10}"
    )
    return "\n".join(lines)


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {
        "topology": {
            "tp": plan.topology.tp,
            "pp": plan.topology.pp,
            "partition": list(plan.topology.partition),
        },
        "stages": list(plan.stages),
        "notes": list(plan.notes),
        "models": [
            {
                "role": m.role,
                "architecture": m.architecture,
                "dtype": m.dtype,
                "skipped": dict(m.skipped),
                "experts": _plan_experts(m.experts),
                "quantization": m.quantization and f"{m.quantization} ({m.scheme})",
                "quantized": quantized_groups(plan, m) if m.quantization else {},
            }
            for m in plan.models
        ],
        "ranks": [asdict(r) for r in plan_rows(plan)],
        "files": [
            {
                "path": f.path,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in f.tensors
                ],
                "bytes": file_bytes(f),
            }
            for f in plan.files
        ],
    }


def artifact_summary(manifest: mf.Manifest) -> dict[str, Any]:
    return {
        "format": manifest.format,
        "shardprep_version": manifest.shardprep_version,
        "vllm_layout": asdict(manifest.vllm_layout),
        "topology": {
            "tp": manifest.topology.tp,
            "pp": manifest.topology.pp,
            "partition": list(manifest.topology.partition),
        },
        "serves": manifest.served_topologies(),
        "served_tps": list(manifest.served_tps),
        "backends": manifest.served_backends(),
        "whole_experts": manifest.whole_experts,  # tp > 1 then needs expert parallelism
        "stages": list(manifest.stages),
        "models": [
            {
                "role": m.role,
                "architecture": m.architecture,
                "method": m.method,
                "dtype": m.dtype,
                "folder": m.folder,
                "source": m.source.repo_id or m.source.model,
                "revision": m.source.revision,
                "experts": asdict(m.experts) if m.experts else None,
            }
            for m in manifest.models
        ],
        "ranks": [asdict(r) for r in manifest_rows(manifest)],
    }


def describe_models(summary: dict[str, Any]) -> str:
    topo = summary["topology"]
    lines = [
        f"topology: tp={topo['tp']} pp={topo['pp']} layers per stage "
        f"{','.join(map(str, topo['partition']))}"
    ]
    if "serves" in summary:
        lines.append(f"serves: {summary['serves']}")
    if "backends" in summary:
        lines.append(f"serves kernel backends: {summary['backends']}")
    for model in summary["models"]:
        source = model.get("source")
        origin = f" from {source}" if source else ""
        lines.append(f"{model['role']}: {model['architecture']} {model['dtype']}{origin}")
        if model.get("quantization"):
            lines.append(f"  quantization: {model['quantization']}")
        for group, params in (model.get("quantized") or {}).items():
            lines.append(f"    {group}: " + ", ".join(f"{n} {d}" for n, d in params.items()))
        if model.get("experts"):
            lines += expert_lines(model["experts"], topo["tp"])
        lines += skipped_lines(model.get("skipped") or {})
    lines += [f"note: {note}" for note in summary.get("notes", ())]
    return "\n".join(lines)


def quantized_groups(plan: Plan, model: ModelPlan) -> dict[str, dict[str, str]]:
    """Each quantized parameter group of a model (layers alike but for their index once):
    {module: {parameter: "dtype [shape on tp rank 0 of its first stage]"}}."""
    groups: dict[str, dict[str, str]] = {}
    quant_params = param_suffixes()  # what a scheme builds beside a quantized weight
    for file in plan.files:
        if file.role != model.role or file.tp != 0:
            continue
        for tensor in file.tensors:
            module, _, param = LAYER_INDEX.sub(".*.", tensor.name).rpartition(".")
            shape = ", ".join(map(str, tensor.shape))
            groups.setdefault(module, {}).setdefault(param, f"{tensor.dtype} [{shape}]")
    return {
        module: dict(sorted(params.items()))
        for module, params in sorted(groups.items())
        if any(name.endswith(quant_params) for name in params)
    }


def skipped_lines(skipped: dict[str, str]) -> list[str]:
    """Source tensors left out of the rank files, one line per reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        by_reason.setdefault(reason, []).append(name)
    lines = []
    for reason, names in by_reason.items():
        noun = "tensor" if len(names) == 1 else "tensors"
        lines.append(f"  left out: {len(names)} {noun}, e.g. {min(names)}: {reason}")
    return lines


def _plan_experts(experts: ExpertPlan | None) -> dict[str, Any] | None:
    if experts is None:
        return None
    split = experts.split
    return {
        "num_experts": split.num_experts,
        "expert_parallel": split.uses_ep,
        "dp": split.dp,
        "placement": split.placement,
        "requested_placement": experts.requested_placement,
        "rank_experts": [list(r) for r in experts.rank_experts],
    }


def expert_lines(experts: dict[str, Any], tp: int) -> list[str]:
    """Which experts each rank holds, one line per EP rank."""
    count = experts["num_experts"]
    if not experts["expert_parallel"]:
        ways = tp * experts["dp"]
        return [f"  experts: {count} per MoE layer, every rank holds all of them, cut {ways} ways"]
    dp = experts["dp"]
    ways = f" over tp {tp} x dp {dp}" if dp > 1 else ""
    lines = [
        f"  experts: {count} per MoE layer, expert parallel{ways}, {experts['placement']} placement"
    ]
    for rank, held in enumerate(experts["rank_experts"]):
        where = f" (dp {rank // tp}, tp {rank % tp})" if dp > 1 else ""
        noun = "expert" if len(held) == 1 else "experts"
        lines.append(f"    ep rank {rank}{where}: {len(held)} {noun}: {_ranges(held)}")
    return lines


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
