"""Check an artifact: file hashes, coverage of every rank's parameters, and optionally a
round trip that rebuilds every source tensor from the rank files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from shardprep import manifest as mf
from shardprep.errors import CorruptFileError, ShardprepError, summarize
from shardprep.layout import Block
from shardprep.safetensors_io import read_header, sha256_file


@dataclass
class Report:
    checked_files: int = 0
    checked_bytes: int = 0
    checked_params: int = 0
    round_trip_tensors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self, out: Path) -> None:
        if self.problems:
            raise CorruptFileError(
                f"{out} failed verification with {len(self.problems)} problem(s): "
                f"{'; '.join(self.problems[:3])}"
                + (f"; and {len(self.problems) - 3} more" if len(self.problems) > 3 else "")
                + ". Re-run `shardprep convert` into this folder to repair it",
                path=str(out),
            )


def verify(out: Path, *, full: bool = False, progress: bool = False) -> Report:
    manifest = mf.read_manifest(out)
    report = Report()
    _check_hashes(out, manifest, report, progress)
    if report.ok:
        _check_coverage(out, manifest, report)
    if full and report.ok:
        _round_trip(out, manifest, report, progress)
    return report


def _check_hashes(out: Path, manifest: mf.Manifest, report: Report, progress: bool) -> None:
    entries = [(f.path, f.bytes, f.sha256) for f in manifest.files]
    entries += [(e.path, e.bytes, e.sha256) for e in manifest.extra_files]
    total = sum(size for _, size, _ in entries)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        for path, size, digest in entries:
            target = out / path
            if not target.is_file():
                report.problems.append(f"{path} is missing")
            elif target.stat().st_size != size:
                report.problems.append(f"{path} has {target.stat().st_size:,} bytes, not {size:,}")
            elif sha256_file(target) != digest:
                report.problems.append(f"{path} does not match its sha256")
            else:
                report.checked_files += 1
                report.checked_bytes += size
            bar.update(size)


def _check_coverage(out: Path, manifest: mf.Manifest, report: Report) -> None:
    """Every parameter each rank needs is present exactly once, with its shape and dtype."""
    for model in manifest.models:
        for key, expected in model.ranks.items():
            pp, tp = mf.parse_rank_key(key)
            found: dict[str, list[str]] = {}
            for entry in manifest.rank_files(model.role, pp, tp):
                header = read_header(out / entry.path)
                for name, info in header.tensors.items():
                    found.setdefault(name, []).append(entry.path)
                    spec = expected.get(name)
                    if spec and (info.dtype, info.shape) != (spec.dtype, tuple(spec.shape)):
                        report.problems.append(
                            f"{model.role} {key}: {name} is {info.dtype}{list(info.shape)}, "
                            f"expected {spec.dtype}{list(spec.shape)}"
                        )
            missing = sorted(set(expected) - set(found))
            extra = sorted(set(found) - set(expected))
            twice = sorted(n for n, files in found.items() if len(files) > 1)
            for what, names in (("missing", missing), ("unexpected", extra), ("repeated", twice)):
                if names:
                    report.problems.append(
                        f"{model.role} {key}: {len(names)} {what} parameter(s): {summarize(names)}"
                    )
            report.checked_params += len(expected)


def _round_trip(out: Path, manifest: mf.Manifest, report: Report, progress: bool) -> None:
    """Re-plan from the source and compare every block of every rank file with the source
    bytes it came from; every source element must be covered."""
    from shardprep.convert import Options, cut_block, load_and_plan

    target = manifest.model("target")
    draft = manifest.model("draft")
    if target is None:
        raise ShardprepError(f"{out} has no target model in its manifest")
    topo = manifest.topology
    options = Options(
        tp=topo.tp,
        pp=topo.pp,
        draft=draft.source.model if draft else None,
        draft_method=draft.method if draft else None,
        partition=",".join(map(str, topo.partition)),
        stage=manifest.stages[0] if len(manifest.stages) == 1 and topo.pp > 1 else None,
        dtype={"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[target.dtype],
        revision=target.source.revision,
    )
    plan, checkpoints = load_and_plan(target.source.repo_id or target.source.model, options)
    located = _locate(out, manifest)
    covered: dict[tuple[str, str], torch.Tensor] = {}
    handles: dict[str, object] = {}
    for file_plan in tqdm(plan.files, desc="round trip", disable=not progress):
        for tensor in file_plan.tensors:
            path = located[(file_plan.role, file_plan.pp, file_plan.tp, tensor.name)]
            dest = _open(handles, out / path).get_tensor(tensor.name)
            dest = dest.reshape(tensor.stacked_shape)
            checkpoint = checkpoints[file_plan.role]
            row = 0
            for block in tensor.blocks:
                rows = block.rows[1] - block.rows[0]
                part = dest[row : row + rows]
                row += rows
                if block.source is None:
                    if torch.count_nonzero(part):
                        report.problems.append(f"{path}: padding of {tensor.name} is not zero")
                    continue
                source_tensor = checkpoint.tensors[block.source]
                source = _open(handles, checkpoint.root / source_tensor.file).get_tensor(
                    block.source
                )
                expected = cut_block(source, block)
                if not _same_bytes(part, expected.to(part.dtype)):
                    report.problems.append(
                        f"{path}: {tensor.name} differs from {block.source} rows {block.rows}"
                    )
                mask = covered.setdefault(
                    (file_plan.role, block.source),
                    torch.zeros(_mask_shape(source), dtype=torch.bool),
                )
                _mark(mask, block)
    for (role, name), mask in covered.items():
        if not bool(mask.all()):
            report.problems.append(f"{role}: parts of {name} are in no rank file")
        report.round_trip_tensors += 1


def _locate(out: Path, manifest: mf.Manifest) -> dict[tuple[str, int, int, str], str]:
    located = {}
    for entry in manifest.files:
        for name in read_header(out / entry.path).tensors:
            located[(entry.role, entry.pp, entry.tp, name)] = entry.path
    return located


def _open(handles: dict[str, object], path: Path) -> object:
    key = str(path)
    if key not in handles:
        handles[key] = safe_open(key, framework="pt")
    return handles[key]


def _mask_shape(source: torch.Tensor) -> tuple[int, ...]:
    if source.dim() == 0:
        return (1,)
    return tuple(source.shape[:2])


def _mark(mask: torch.Tensor, block: Block) -> None:
    """Mark the source rows (and columns) that `block` reads."""
    (up, across), rows, cols = block.repeat, block.rows, block.cols
    first, last = rows[0] // up, -(-rows[1] // up)
    if cols is None:
        mask[first:last] = True
    else:
        mask[first:last, cols[0] // across : -(-cols[1] // across)] = True


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_as_bytes(a), _as_bytes(b)))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
