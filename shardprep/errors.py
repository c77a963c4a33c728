"""One exception family. Each subclasses the built-in that callers already catch."""

from __future__ import annotations

import re
from collections.abc import Iterable


class ShardprepError(Exception):
    """Base of every error shardprep raises on purpose."""


class ConfigError(ShardprepError, ValueError):
    """A source model, its config.json or a command-line option is not usable."""


class PlanError(ShardprepError, ValueError):
    """The checkpoint cannot be split for the requested topology."""


class ManifestError(ShardprepError, ValueError):
    """An artifact's manifest is missing, malformed or of an unknown version."""


class OutputExistsError(ShardprepError, FileExistsError):
    """The output folder holds something that is not this artifact."""


class OutputLockedError(ShardprepError, BlockingIOError):
    """Another convert is writing the same output folder."""


class OutputWriteError(ShardprepError, OSError):
    """Writing the artifact failed (no space, a file size limit, permissions...)."""

    def __str__(self) -> str:
        return self.args[0]


class _FileError(ShardprepError, OSError):
    """An error about one file, which it keeps in `path`."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return self.args[0]


class CorruptFileError(_FileError):
    """A file's bytes are not what its header or the manifest promise."""


class MissingRankFileError(_FileError, FileNotFoundError):
    """A file that the manifest lists for this rank is not on disk."""


class WeightMismatchError(ShardprepError, ValueError):
    """The rank files do not fit the parameters vLLM built on this rank."""


class TopologyMismatchError(ShardprepError, RuntimeError):
    """An artifact was built for another parallel layout than the one running."""


class LayoutMismatchError(ShardprepError, RuntimeError):
    """The running vLLM builds another parameter layout than the artifact holds, or one
    that it cannot fill by copying (online quantization, substituted experts)."""


class HubError(ShardprepError, OSError):
    """Publishing to or fetching from the Hugging Face Hub failed."""

    def __str__(self) -> str:
        return self.args[0]


def summarize(items: Iterable[str], limit: int = 3) -> str:
    """'a, b, c and 4 more' — never a wall of names in a message."""
    items = list(items)
    shown = ", ".join(items[:limit])
    rest = len(items) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: object, limit: int | None = None) -> str:
    """`text` fit for one line on a terminal: line breaks and tabs become spaces, every other
    control character (an escape code a server or a file name carried) a visible `\\xNN`;
    past `limit` characters it is cut, saying how many were left out."""
    line = _CONTROL.sub(_visible, str(text))
    if limit is not None and len(line) > limit:
        line = f"{line[:limit]}… ({len(line) - limit:,} more characters)"
    return line


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    return " " if char in "\n\r\t\u2028\u2029" else f"\\x{ord(char):02x}"
