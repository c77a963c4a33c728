"""Check an artifact: file hashes, coverage of every rank's parameters, and optionally a
round trip that rebuilds every source tensor from the rank files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shardprep.constants import DRAFT_DIR, FETCHED_MANIFEST, SHARDS_DIR, STATE_DIR
from shardprep.errors import CorruptFileError, ShardprepError, summarize
from shardprep.format import manifest as mf
from shardprep.format.headers import read_header
from shardprep.hashing import sha256_file
from shardprep.progress import Progress as tqdm


@dataclass
class Report:
    checked_files: int = 0
    checked_bytes: int = 0
    checked_params: int = 0
    round_trip_tensors: int = 0
    problems: list[str] = field(default_factory=list)
    stages: list[int] = field(default_factory=list)  # the stages of the manifest
    pp: int = 1
    checked: list[tuple[int, int]] = field(default_factory=list)  # (stage, tp rank) here
    absent: list[tuple[int, int]] = field(default_factory=list)  # not fetched into this folder
    fetched: bool = False  # a folder of the fetch cache, which may hold some stages only
    # The problems are the round trip's: every file matches the manifest's sha256.
    rebuilt_differ: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def complete(self) -> bool:
        """Every rank of every stage of the manifest was here and checked."""
        return not self.absent

    def scope(self) -> str:
        """Which stages and ranks were checked, in words."""
        stages = sorted({pp for pp, _ in self.checked})
        text = f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
        if self.complete:
            return text if len(stages) == self.pp else f"{text} of pp={self.pp}"
        partial = sorted({pp for pp, _ in self.absent} & set(stages))
        missing = [s for s in self.stages if s not in stages]
        notes = [f"stage {p} holds only {_ranks(self.checked, p)}" for p in partial]
        if missing:
            plural = "s" if len(missing) > 1 else ""
            notes.append(f"stage{plural} {', '.join(map(str, missing))} not fetched here")
        return "; ".join([f"{text} of {', '.join(map(str, self.stages))}", *notes])

    def raise_if_failed(self, out: Path) -> None:
        if self.problems:
            raise CorruptFileError(
                f"{out} failed verification with {len(self.problems)} problem(s): "
                f"{'; '.join(self.problems[:3])}"
                + (f"; and {len(self.problems) - 3} more" if len(self.problems) > 3 else "")
                + self._advice(),
                path=str(out),
            )

    def _advice(self) -> str:
        if self.rebuilt_differ:
            return (
                ". Its files match the manifest's sha256 but not the source: the manifest is "
                "not the one convert wrote, or the source changed since; convert into a new "
                "folder (a rerun here keeps files that match the manifest)"
            )
        return ". Re-run `shardprep convert` into this folder to repair it" + (
            " (a fetched one: `shardprep fetch --verify` downloads them again)"
            if self.fetched
            else ""
        )


def _ranks(units: list[tuple[int, int]], stage: int) -> str:
    ranks = [str(tp) for pp, tp in units if pp == stage]
    return f"tp rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


def verify(
    out: Path,
    *,
    full: bool = False,
    progress: bool = False,
    source_budget: int | None = None,
    source_watch: Callable[[], None] | None = None,
) -> Report:
    """Check the artifact in `out`. A folder that `shardprep fetch` filled may hold only
    some stages (or ranks): those are checked, and the report says which. `full`: also
    rebuild every source tensor (`round_trip.py`), a Hub source's files downloaded into the
    Hugging Face cache, or with `source_budget` into a temporary folder, at most that many
    bytes of them at once (`source_watch` is called whenever that folder may peak)."""
    manifest = mf.read_manifest(out)
    report = Report(stages=list(manifest.stages), pp=manifest.topology.pp)
    units = sorted({(f.pp, f.tp) for f in manifest.files})
    # A fetched folder is told by the manifest fetch keeps, not by a folder's presence.
    report.fetched = (out / STATE_DIR / FETCHED_MANIFEST).is_file()
    if report.fetched:
        here = {(f.pp, f.tp) for f in manifest.files if (out / f.path).exists()}
        report.absent = [u for u in units if u not in here]
    absent = set(report.absent)
    report.checked = [u for u in units if u not in absent]
    if not report.checked:
        report.problems.append("no rank file of any stage is in this folder")
        return report
    checked = set(report.checked)
    files = [f for f in manifest.files if (f.pp, f.tp) in checked]
    _check_hashes(out, manifest, files, report, progress)
    _check_no_stray_files(out, manifest, report)
    if report.ok:
        _check_coverage(out, manifest, report)
        _check_ranks_agree(manifest, report)
    if full and report.ok:
        from shardprep.convert.round_trip import round_trip  # imports torch

        problems, report.round_trip_tensors = round_trip(
            out,
            manifest,
            checked,
            complete=report.complete,
            progress=progress,
            budget=source_budget,
            watch=source_watch,
        )
        report.problems += problems
        report.rebuilt_differ = bool(problems)
    return report


def _check_hashes(
    out: Path, manifest: mf.Manifest, files: list[mf.FileEntry], report: Report, progress: bool
) -> None:
    entries = [(f.path, f.bytes, f.sha256) for f in files]
    entries += [(e.path, e.bytes, e.sha256) for e in manifest.side_files]
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


def _check_no_stray_files(out: Path, manifest: mf.Manifest, report: Report) -> None:
    """No file under the rank folders that the manifest does not list: what an earlier,
    interrupted convert left there (a rerun of convert removes it)."""
    listed = {f.path for f in manifest.files}
    stray = []
    for name in (SHARDS_DIR, f"{DRAFT_DIR}/{SHARDS_DIR}"):
        folder = out / name
        if folder.is_symlink() or not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            rel = f"{name}/{path.name}"
            if rel not in listed and (path.is_symlink() or not path.is_dir()):
                stray.append(rel)
    if stray:
        report.problems.append(
            f"{summarize(stray)} {'are' if len(stray) > 1 else 'is'} not listed in the manifest "
            "(left by an earlier convert: rerun that convert, which removes it, or delete it)"
        )


def _check_coverage(out: Path, manifest: mf.Manifest, report: Report) -> None:
    """Every parameter each rank needs is present exactly once, with its shape and dtype,
    in headers that pass the strict parser."""
    checked = set(report.checked)
    by_rank: dict[tuple[str, int, int, int | None], list[mf.FileEntry]] = {}
    for entry in manifest.files:
        by_rank.setdefault((entry.role, entry.pp, entry.tp, entry.dp), []).append(entry)
    for model in manifest.models:
        for key, expected in model.ranks.items():
            pp, tp, dp = mf.split_rank_key(key)
            if (pp, tp) not in checked:
                continue
            found: dict[str, list[str]] = {}
            unreadable = False
            for entry in by_rank.get((model.role, pp, tp, dp), []):
                try:
                    header = read_header(out / entry.path)
                except ShardprepError as exc:
                    report.problems.append(str(exc))
                    unreadable = True
                    continue
                for name, info in header.tensors.items():
                    found.setdefault(name, []).append(entry.path)
                    spec = expected.get(name)
                    if spec and (info.dtype, info.shape) != (spec.dtype, tuple(spec.shape)):
                        report.problems.append(
                            f"{model.role} {key}: {name} is {info.dtype}{list(info.shape)}, "
                            f"expected {spec.dtype}{list(spec.shape)}"
                        )
            if unreadable:
                continue
            missing = sorted(set(expected) - set(found))
            extra = sorted(set(found) - set(expected))
            twice = sorted(n for n, files in found.items() if len(files) > 1)
            for what, names in (("missing", missing), ("unexpected", extra), ("repeated", twice)):
                if names:
                    report.problems.append(
                        f"{model.role} {key}: {len(names)} {what} parameter(s): {summarize(names)}"
                    )
            report.checked_params += len(expected)


def _check_ranks_agree(manifest: mf.Manifest, report: Report) -> None:
    """Tensor parallel ranks of one stage hold slices of the same parameters: a name on
    one rank and not on another means the manifest lost part of the model."""
    if manifest.topology.expert_parallel:
        return
    for model in manifest.models:
        by_stage: dict[int, dict[int, frozenset[str]]] = {}
        for key, params in model.ranks.items():
            pp, tp, dp = mf.split_rank_key(key)
            if dp is None:
                by_stage.setdefault(pp, {})[tp] = frozenset(params)
        for pp, ranks in sorted(by_stage.items()):
            names = ranks[min(ranks)]
            odd = sorted(tp for tp, other in ranks.items() if other != names)
            if odd:
                differ = sorted(names ^ ranks[odd[0]])
                report.problems.append(
                    f"{model.role} stage {pp}: tp rank {odd[0]} and tp rank {min(ranks)} hold "
                    f"different parameters ({summarize(differ)})"
                )
