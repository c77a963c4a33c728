"""The command line: one subcommand per function of `commands`, its flags from `flags`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from shardprep import __version__
from shardprep.cli.commands import (
    cmd_convert,
    cmd_demo,
    cmd_fetch,
    cmd_inspect,
    cmd_plan,
    cmd_publish,
    cmd_verify,
)
from shardprep.cli.flags import add_convert_flags, add_hub_flags


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
