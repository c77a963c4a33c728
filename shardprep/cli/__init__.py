"""The `shardprep` command: thin wrappers that parse flags and call the library."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardprep import __version__, report
from shardprep.cli.flags import add_convert_flags, add_hub_flags
from shardprep.constants import debug_enabled
from shardprep.errors import ConfigError, ShardprepError, printable
from shardprep.sizes import flag_size
from shardprep.terminal import Terminated, error_line, quiet_output, terminate


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardprep",
        description="Pre-shard checkpoints for vLLM tensor and pipeline parallelism.",
    )
    parser.add_argument("--version", action="version", version=f"shardprep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: list[tuple[str, str, Callable[[argparse.Namespace], None]]] = [
        ("convert", "split a checkpoint (and its draft) into per-rank files", cmd_convert),
        ("plan", "dry run: validate and show the per-rank table, write nothing", cmd_plan),
        ("verify", "check hashes and coverage of an artifact", cmd_verify),
        ("inspect", "show what an artifact holds, per stage and rank", cmd_inspect),
        ("publish", "upload a verified artifact to the Hugging Face Hub", cmd_publish),
        ("fetch", "download one stage of a published artifact into the cache", cmd_fetch),
        ("demo", "convert a tiny built-in model at tp2 x pp2 and show the result", cmd_demo),
    ]
    for name, help_text, func in commands:
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(func=func)
        command.add_argument("--json", action="store_true", help="machine-readable output")
        if name not in ("inspect", "demo"):  # the others show progress
            command.add_argument("-q", "--quiet", action="store_true", help="no progress output")
        if name in ("convert", "plan"):
            add_convert_flags(command)
        if name == "convert":
            command.add_argument(
                "-o", "--output", metavar="OUT", required=True, help="artifact folder to write"
            )
            command.add_argument(
                "--rehash-source",
                action="store_true",
                help="hash source files whose sha256 is known too (default: a Hugging Face "
                "cache blob's name, or the sha256 `hf download --local-dir` recorded, is "
                "recorded as it is)",
            )
            command.add_argument(
                "--source-budget",
                metavar="SIZE",
                help="download a Hub source's weight files into the output folder, not the "
                "Hugging Face cache, each deleted once converted, at most SIZE of them on "
                "disk at once (default: None, the cache)",
            )
        if name in ("verify", "inspect"):
            command.add_argument("artifact", metavar="OUT", help="artifact folder")
        if name == "verify":
            command.add_argument(
                "--full", action="store_true", help="also rebuild every source tensor and compare"
            )
            command.add_argument(
                "--source-budget",
                metavar="SIZE",
                help="with --full: download a Hub source's files that the Hugging Face cache "
                "lacks into a temporary folder, not the cache, each deleted once compared, at "
                "most SIZE of them on disk at once (default: None, the cache)",
            )
        if name in ("publish", "fetch"):
            add_hub_flags(command, name)
        if name == "demo":
            command.add_argument("--keep", action="store_true", help="keep the temporary folder")
    return parser


def _resume(args: argparse.Namespace) -> str:
    """What to do after a stop: a command that writes resumes where it stopped; one that
    only reads (plan, verify, inspect) has nothing to resume."""
    if args.func in (cmd_plan, cmd_verify, cmd_inspect):
        return ""
    return "; rerun the same command to resume"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        signal.signal(signal.SIGTERM, terminate)
    try:
        with quiet_output(getattr(args, "quiet", False)):
            args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # The reader went away (`| head -1`): as the Python docs advise, send the rest of the
        # output to devnull so that the flush at exit stays silent. The reader took what it
        # wanted, and whether it went before or after the last write is a race: exit 0.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except ShardprepError as exc:
        if debug_enabled():
            traceback.print_exc()
        print(error_line(exc), file=sys.stderr)
        return 1
    except OSError as exc:  # an I/O failure no library function turned into a message
        if debug_enabled():
            traceback.print_exc()
        where = f" ({exc.filename})" if exc.filename else ""
        print(error_line(f"{exc.strerror or exc}{where}"), file=sys.stderr)
        return 1
    except Terminated:
        print(f"shardprep: terminated{_resume(args)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"shardprep: interrupted{_resume(args)}", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0
