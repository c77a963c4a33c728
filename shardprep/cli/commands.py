"""What each command does: check its flags, call the library, print the result (data on
stdout, as JSON with --json; progress and warnings on stderr)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardprep import report
from shardprep.cli.sizes import flag_size
from shardprep.errors import ConfigError, printable


def _source_budget(args: argparse.Namespace) -> int | None:
    text = getattr(args, "source_budget", None)
    return None if text is None else flag_size("--source-budget", text)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """The result on stdout: JSON (which escapes control characters), or `text`, whose
    strings from a manifest, a config or a server may hold escape codes: each line is
    printed with its control characters made visible, as error lines are."""
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        print("\n".join(printable(line) for line in text.split("\n")))


def _options(args: argparse.Namespace) -> Any:
    from shardprep.convert.run import Options

    if args.tp < 1:
        raise ConfigError(f"--tp {args.tp}: the tensor parallel size is at least 1")
    if args.pp_partition is not None and not args.pp_partition.strip():
        raise ConfigError(
            "--pp-partition is empty; give the layers per stage, e.g. --pp-partition 31,30, "
            "or leave the flag out for vLLM's split"
        )
    if args.draft_method and not args.draft:
        raise ConfigError(
            f"--draft-method {args.draft_method} needs --draft DRAFT (the draft model it "
            "describes); leave it out to convert the target alone"
        )
    max_part_bytes = flag_size("--max-part-size", args.max_part_size)
    return Options(
        tp=args.tp,
        pp=args.pp,
        draft=args.draft,
        draft_method=args.draft_method,
        partition=args.pp_partition,
        stage=args.stage,
        max_part_bytes=max_part_bytes,
        dtype=args.dtype,
        revision=args.revision,
        endpoint=args.endpoint,
        rehash_source=getattr(args, "rehash_source", False),
        source_budget=_source_budget(args),
        expert_parallel=args.enable_expert_parallel,
        expert_placement=args.expert_placement_strategy,
        dp=args.dp,
        mtp_draft=not args.no_mtp,
        mxfp4_pad=args.mxfp4_pad,
    )


def cmd_convert(args: argparse.Namespace) -> None:
    from shardprep.convert.run import convert_folder

    # Progress (the download and convert bars) on stderr, unless --quiet or --json.
    progress = not (args.quiet or args.json)
    done = convert_folder(args.model, Path(args.output), _options(args), progress=progress)
    summary = report.artifact_summary(done.manifest)
    summary["kept_files"], summary["written_files"] = done.kept, done.written
    summary["notes"] = list(done.notes)
    if done.written == 0:
        head = (
            f"{args.output} was already complete: all {done.kept} rank files verified against "
            "their sha256, none rewritten"
        )
    elif done.kept:
        head = (
            f"wrote {args.output} ({done.written} rank files written, {done.kept} found "
            "complete and verified)"
        )
    else:
        head = f"wrote {args.output}"
    notes = "".join(f"\nnote: {note}" for note in done.notes)
    _emit(args, summary, head + notes + "\n" + report.table(report.manifest_rows(done.manifest)))


def cmd_plan(args: argparse.Namespace) -> None:
    from shardprep.convert.run import load_and_plan

    plan, _ = load_and_plan(args.model, _options(args))
    summary = report.plan_summary(plan)
    text = report.describe_models(summary) + "\n" + report.table(report.plan_rows(plan))
    _emit(args, summary, text)


def cmd_verify(args: argparse.Namespace) -> None:
    from shardprep.convert.verify import verify

    out = Path(args.artifact)
    budget = _source_budget(args)
    if budget is not None and not args.full:
        raise ConfigError("--source-budget is for `verify --full`, which reads the source")
    result = verify(out, full=args.full, progress=not args.quiet, source_budget=budget)
    result.raise_if_failed(out)
    data = {
        "ok": True,
        "files": result.checked_files,
        "bytes": result.checked_bytes,
        "params": result.checked_params,
        "round_trip_tensors": result.round_trip_tensors,
        "stages": sorted({pp for pp, _ in result.checked}),
        "complete": result.complete,
    }
    text = (
        f"ok ({result.scope()}): {result.checked_files} files "
        f"({report.format_bytes(result.checked_bytes)}) match "
        f"their sha256; {result.checked_params} rank parameters present exactly once"
        + (
            f"; {result.round_trip_tensors} source tensors rebuilt byte for byte"
            if args.full
            else ""
        )
    )
    _emit(args, data, text)


def cmd_inspect(args: argparse.Namespace) -> None:
    from shardprep.format.manifest import read_manifest

    manifest = read_manifest(Path(args.artifact))
    summary = report.artifact_summary(manifest)
    text = report.describe_models(summary) + "\n" + report.table(report.manifest_rows(manifest))
    _emit(args, summary, text)


def cmd_publish(args: argparse.Namespace) -> None:
    from shardprep.hub.publish import publish

    commit = publish(
        Path(args.artifact), args.repo_id, private=args.private, revision=args.revision,
        compress=args.compress, endpoint=args.endpoint, progress=not args.quiet,
    )  # fmt: skip
    data = {
        "repo_id": args.repo_id,
        "revision": args.revision,
        "commit": commit,
        "compress": args.compress or "none",
    }
    _emit(args, data, f"published {args.artifact} to {args.repo_id}@{args.revision}: {commit}")


def cmd_fetch(args: argparse.Namespace) -> None:
    from shardprep.hub.cache import fetch

    folder = fetch(
        args.repo_id, stage=args.stage, rank=args.rank, all_stages=args.all, pp=args.pp,
        tp=args.tp, revision=args.revision, cache_dir=args.cache_dir, endpoint=args.endpoint,
        progress=not args.quiet, verify=args.verify,
    )  # fmt: skip
    data = {
        "repo_id": args.repo_id,
        "commit": folder.name,
        "path": str(folder),
        "stage": args.stage,
        "rank": args.rank,
        "all": args.all,
        "pp": args.pp,
        "tp": args.tp,
    }
    _emit(args, data, str(folder))


def cmd_demo(args: argparse.Namespace) -> None:
    from shardprep.demo.run import run_demo

    data, text = run_demo(keep=args.keep)
    _emit(args, data, text)
