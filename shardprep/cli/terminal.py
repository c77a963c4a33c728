"""What a terminal sees of a command: one bounded error line, SIGTERM taken as Ctrl-C,
and `--quiet` (nothing but the result or the error line)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from shardprep.errors import printable

HF_LOGGER = "huggingface_hub"  # the Hugging Face client's root logger
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
    Hugging Face client's own stderr handler muted, also when the client is first imported
    during the command) and no warning is shown. For the command's time only: main() may
    be called again in the same process."""
    if not enabled:
        yield
        return
    root, null, client = logging.getLogger(), logging.NullHandler(), logging.getLogger(HF_LOGGER)
    muted: list[tuple[logging.Handler, int]] = []

    def mute(handler: logging.Handler) -> None:
        if type(handler) is logging.StreamHandler:
            muted.append((handler, handler.level))
            handler.setLevel(logging.CRITICAL + 1)

    def add_muted(handler: logging.Handler) -> None:
        logging.Logger.addHandler(client, handler)
        mute(handler)

    for handler in (*root.handlers, *client.handlers):
        mute(handler)
    # The client adds its stderr handler (where its retry warnings go) when it is first
    # imported, which a command does only when it needs the Hub: muted as it is added.
    # On this logger only, until the `finally` below deletes it: an instance attribute that
    # shadows the method (which mypy reads as assigning to a method).
    client.addHandler = add_muted  # type: ignore[assignment]
    root.addHandler(null)  # a handler is found: logging's last resort prints nothing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        del client.addHandler
        root.removeHandler(null)
        for handler, level in muted:
            handler.setLevel(level)
