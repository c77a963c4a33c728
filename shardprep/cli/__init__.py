"""The `shardprep` command: thin wrappers that parse flags and call the library.

`parser` builds the command line (the flags in `flags`), `commands` holds what each
command does, and `entry.main` runs one and turns a failure into one line.
"""

from __future__ import annotations

from shardprep.cli.entry import main
from shardprep.cli.parser import build_parser

__all__ = ["build_parser", "main"]
