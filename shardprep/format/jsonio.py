"""Strict JSON for documents that come from elsewhere (headers, indexes, manifests).

`json.loads` alone accepts UTF-16, `NaN`, duplicate keys (the last one wins) and lone
surrogates, and answers deep nesting or a 5,000-digit number with a RecursionError or a bare
ValueError. `parse` refuses all of these with one `JSONProblem` that says why; callers turn
it into the error of their own kind, naming the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


class JSONProblem(ValueError):
    """Why a document is not strict JSON; the message completes "FILE ..."."""


def parse(raw: bytes | str, *, limit: int, pairs: Callable[[Any], int] | None = None) -> Any:
    """Parse UTF-8 JSON of at most `limit` bytes (checked before decoding).

    `pairs` counts the key-value pairs of the objects of a document of a known form (a
    safetensors header: an object of objects). When its count equals the text's colons,
    no object can have repeated a key (each pair has a colon, and a repeat would be lost
    from the count), so the parse skips the check it otherwise makes of every object."""
    if len(raw) > limit:
        raise JSONProblem(f"is {len(raw):,} bytes, over the {limit:,}-byte limit")
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONProblem(f"is not UTF-8 (byte {exc.start})") from None
    else:
        text = raw
    try:
        value = _loads(text, pairs)
    except JSONProblem:
        raise
    except RecursionError:
        raise JSONProblem("nests too deeply to be read") from None
    except ValueError as exc:  # JSONDecodeError, and int() refusing a huge number
        raise JSONProblem(f"does not parse as JSON ({shorten(str(exc), 120)})") from None
    if "\\u" in text:  # UTF-8 holds no surrogate: only an escape can make one
        _check_strings(value)
    return value


def _loads(text: str, pairs: Callable[[Any], int] | None) -> Any:
    if pairs is not None:
        value = json.loads(text, parse_constant=_no_constant)
        if pairs(value) == text.count(":"):
            return value
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def parse_file(path: Path, *, limit: int) -> Any:
    """`parse` on a file's bytes, its size checked before it is read."""
    size = path.stat().st_size
    if size > limit:
        raise JSONProblem(f"is {size:,} bytes, over the {limit:,}-byte limit")
    return parse(path.read_bytes(), limit=limit)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)  # called once per JSON object: no Python loop unless a key repeats
    if len(result) != len(pairs):
        raise JSONProblem(f"names the key {shorten(_repeated(pairs))!r} twice in one object")
    return result


def _repeated(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no key repeats")


def _no_constant(name: str) -> Any:
    raise JSONProblem(f"holds {name}, which is not a JSON number")


def _check_strings(value: Any) -> None:
    """No lone surrogate anywhere: they cannot be written to a file name or a UTF-8 file."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings: list[str] = [item]
        elif isinstance(item, dict):
            strings = list(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in strings:
            if not text.isascii() and _SURROGATE.search(text):
                raise JSONProblem(f"holds a lone surrogate in {shorten(text)!r}")


def shorten(text: str, limit: int = 60) -> str:
    """A name fit for a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
