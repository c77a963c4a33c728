"""`main`: run one command, turn a `ShardprepError` (or an I/O failure, a stop, a reader
that went away) into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence

from shardprep.cli.commands import cmd_inspect, cmd_plan, cmd_verify
from shardprep.cli.parser import build_parser
from shardprep.cli.terminal import Terminated, error_line, quiet_output, terminate
from shardprep.constants import debug_enabled
from shardprep.errors import ShardprepError


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
