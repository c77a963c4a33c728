"""safetensors files made by hand, and what an attacker would hand shardprep: rewritten
headers and manifests, made on real artifacts so that only the one field under test is
wrong."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardprep.constants import MANIFEST_NAME


def pack(header: dict[str, Any] | str | bytes, data: bytes = b"") -> bytes:
    """A safetensors file: length prefix, header (a dict, or raw text), data."""
    if isinstance(header, dict):
        raw = json.dumps(header).encode()
    else:
        raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + data


def safetensors_bytes(tensors: list[tuple[str, str, list[int], bytes]]) -> bytes:
    """A well-formed safetensors file of (name, dtype, shape, data), in the given order
    (save_file sorts by dtype, which would never put a bf16 tensor at an odd offset)."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return pack(text, b"".join(t[3] for t in tensors))


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """The header dict and the data bytes of a safetensors file."""
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    header, data = split(path.read_bytes())
    edit(header)
    path.write_bytes(pack(header, data))


def edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = folder / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def rehash(folder: Path, data: dict[str, Any]) -> None:
    """Make every file entry's size and sha256 agree with the bytes on disk, as an
    attacker who controls the whole artifact would."""
    for entry in data["files"] + data["extra_files"]:
        path = folder / entry["path"]
        if path.is_file():
            blob = path.read_bytes()
            entry["bytes"] = len(blob)
            entry["sha256"] = hashlib.sha256(blob).hexdigest()
