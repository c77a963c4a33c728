"""Sizes as people write them on a command line: 5GiB, 500MB, 1.5GB, 1000000."""

from __future__ import annotations

import re
from decimal import Decimal

from shardprep.errors import ConfigError, printable

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """'5GiB', '500MB', '1.5GB', '1000000' -> bytes (at least one)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {text!r} is not understood; write it as e.g. 5GiB or 500MB")
    size = int(Decimal(match.group(1)) * _UNITS[match.group(2).lower()])  # exact, no inf
    if not 1 <= size < 2**63:
        raise ConfigError(
            f"size {printable(text, 40)!r} is not a size a file can have; write e.g. 5GiB"
        )
    return size


def flag_size(flag: str, text: str) -> int:
    """parse_size, its error naming the flag it came from."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
