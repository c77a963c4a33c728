"""Progress bars on a terminal; plain lines anywhere else (logs, CI, a pipe).

`Progress` is a drop-in for `tqdm.tqdm`. When its stream is not a terminal it writes no
carriage return and no escape code: one plain line when it starts, at most one line per
`PLAIN_INTERVAL_S` while it runs, and one when it ends. Nested bars that are not kept
(huggingface_hub's per-file bars) print only their start and their progress lines.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm

PLAIN_INTERVAL_S = 30.0


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Sink:
    """Where tqdm's own terminal output goes when plain lines are written instead."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class Progress(tqdm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stream = kwargs.get("file") or sys.stderr
        self._plain_out: TextIO | None = None
        if not is_terminal(stream):
            self._plain_out = stream
            kwargs["file"] = _Sink()
            kwargs["mininterval"] = max(float(kwargs.get("mininterval") or 0), PLAIN_INTERVAL_S)
            kwargs["ascii"] = True
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self._plain_out is None:
            return bool(super().display(msg, pos))
        if msg is None:  # msg "" only clears a bar: nothing to print on a plain stream
            line = self.format_meter(**{**self.format_dict, "ncols": 0}).strip()
            self._plain_out.write(line + "\n")
            self._plain_out.flush()
        return True


class Silent(tqdm):
    """A bar that never shows, for clients that take a tqdm class (huggingface_hub)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
