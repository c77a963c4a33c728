"""What a terminal sees of a command: one bounded error line, SIGTERM taken as Ctrl-C,
and `--quiet` (nothing but the result or the error line)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from shardprep.errors import printable

MAX_ERROR_CHARS = 1000  # an error line longer than this is cut, saying how much was left out


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken the way Ctrl-C is: temporary files removed, the work resumable."""


def terminate(signum: int, frame: object) -> None:
    raise Terminated


def error_line(message: object) -> str:
    """One line of at most MAX_ERROR_CHARS characters: line breaks and every other control
    character (an escape code a server or a file name carried) become spaces or escapes."""
    return f"shardprep: error: {printable(message, MAX_ERROR_CHARS)}"


@contextlib.contextmanager
def quiet_output(enabled: bool) -> Iterator[None]:
    """--quiet: only the result, or the one error line, on the terminal: log records still
    reach the handlers a caller installed, but none is printed (no last-resort handler, the
    Hugging Face client's own stderr handler muted) and no warning is shown. For the
    command's time only: main() may be called again in the same process."""
    if not enabled:
        yield
        return
    # The client adds its stderr handler when this module is first imported (its retry
    # warnings go there): imported here, so that the handler exists to be muted.
    import huggingface_hub.utils.logging  # noqa: F401

    root, null = logging.getLogger(), logging.NullHandler()
    printing = [
        handler
        for logger in (root, logging.getLogger("huggingface_hub"))
        for handler in logger.handlers
        if type(handler) is logging.StreamHandler
    ]
    levels = [handler.level for handler in printing]
    root.addHandler(null)  # a handler is found: logging's last resort prints nothing
    for handler in printing:
        handler.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.removeHandler(null)
        for handler, level in zip(printing, levels, strict=True):
            handler.setLevel(level)
