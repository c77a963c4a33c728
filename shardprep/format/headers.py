"""A strict safetensors header parser and a streaming writer.

safetensors itself has no streaming writer (`save_file` needs every tensor in memory),
so the writer builds the header from the plan, then takes each tensor's bytes in order,
hashing as it goes.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any, NamedTuple

from shardprep.constants import MAX_HEADER_BYTES
from shardprep.errors import CorruptFileError
from shardprep.format import jsonio
from shardprep.format.dtypes import DTYPE_SIZES

ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class TensorInfo(NamedTuple):
    """Where one tensor's bytes lie in a safetensors file (`offset` is absolute). A named
    tuple: a flagship's headers make half a million of them."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a scalar)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def read_header(path: Path) -> Header:
    """Parse and check a safetensors header: size limit first, then every entry, then that
    the tensors tile the data area exactly, with no hole, overlap or trailing byte."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _corrupt(path, "is not a regular file")
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = header_length(path, prefix, info.st_size)
        raw = f.read(length)
    return _parse(path, raw, length, info.st_size)


def parse_header(data: bytes, file_size: int | None = None, where: str = "header") -> Header:
    """The same checks as `read_header`, on bytes that start a file of `file_size` bytes
    (default: `data` is the whole file)."""
    file_size = len(data) if file_size is None else file_size
    length = header_length(where, data[:8], file_size)
    if len(data) < 8 + length:
        raise _corrupt(where, "is truncated inside its header")
    return _parse(where, data[8 : 8 + length], length, file_size)


def header_length(where: Path | str, prefix: bytes, file_size: int) -> int:
    """The header length the first 8 bytes of a file of `file_size` bytes declare,
    refused before anything of that size is allocated (or read over the network)."""
    if len(prefix) < 8 or file_size < 8:
        raise _corrupt(where, "is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise _corrupt(
            where, f"declares a {length:,}-byte header, over the {MAX_HEADER_BYTES:,} limit"
        )
    if 8 + length > file_size:
        raise _corrupt(where, "is truncated inside its header")
    return length


def _parse(where: Path | str, raw: bytes, length: int, file_size: int) -> Header:
    if len(raw) != length:
        raise _corrupt(where, "is truncated inside its header")
    try:
        entries = jsonio.parse(raw, limit=MAX_HEADER_BYTES, pairs=_pairs)
    except jsonio.JSONProblem as exc:
        raise _corrupt(where, f"has a header that is not JSON: it {exc}") from None
    if not isinstance(entries, dict):
        raise _corrupt(where, "has a header that is not a JSON object")
    metadata = _metadata(where, entries.pop("__metadata__", None))
    data_start = 8 + length
    data_size = file_size - data_start
    counted = _all_counts(entries.values())
    tensors = {
        name: _tensor_info(where, name, entry, data_start, data_size, counted)
        for name, entry in entries.items()
    }
    _check_tiling(where, tensors, data_start, file_size)
    return Header(tensors=tensors, metadata=metadata, data_start=data_start, file_size=file_size)


def _pairs(header: Any) -> int:
    """The key-value pairs of a header's objects: its own, and those of the objects it
    holds (tensor entries, `__metadata__`); -1 for any other form."""
    if type(header) is not dict:
        return -1
    inner = [value for value in header.values() if type(value) is dict]
    return len(header) + sum(map(len, inner))


def _metadata(where: Path | str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _corrupt(where, "has a __metadata__ that is not a map of strings to strings")
    return value


def _are_counts(values: list[Any]) -> bool:
    """JSON integers >= 0: not bools, not floats, not strings."""
    return not values or (set(map(type, values)) == {int} and min(values) >= 0)


def _all_counts(entries: Iterable[Any]) -> bool:
    """Whether every value in the entries' shapes and data_offsets is an integer >= 0,
    asked of them all at once (in C); False, to ask entry by entry, for any other form."""
    try:
        values = [*chain.from_iterable(map(itemgetter("shape"), entries))]
        values += chain.from_iterable(map(itemgetter("data_offsets"), entries))
    except (TypeError, KeyError, IndexError):
        return False
    return _are_counts(values)


def _tensor_info(
    where: Path | str,
    name: str,
    entry: object,
    data_start: int,
    data_size: int,
    counted: bool = False,
) -> TensorInfo:
    """`counted`: every value of every entry's lists is an integer >= 0 (`_all_counts`),
    so only each list itself is looked at."""
    # Runs once per tensor (half a million in a flagship's headers): the checks are
    # written to stay in C where they can.
    shown = jsonio.shorten(name)
    if type(entry) is not dict or entry.keys() != ENTRY_KEYS:
        raise _corrupt(
            where, f"has a header entry for {shown!r} that is not {{dtype, shape, data_offsets}}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise _corrupt(
            where,
            f"uses dtype {jsonio.shorten(str(dtype))!r} for {shown!r}, which shardprep "
            f"does not know ({', '.join(DTYPE_SIZES)})",
        )
    if type(shape) is not list or not (counted or _are_counts(shape)):
        raise _corrupt(where, f"gives {shown!r} a shape that is not a list of integers >= 0")
    if type(offsets) is not list or len(offsets) != 2 or not (counted or _are_counts(offsets)):
        raise _corrupt(
            where, f"gives {shown!r} data_offsets that are not two integers >= 0 [begin, end]"
        )
    begin, end = offsets
    if begin > end:
        raise _corrupt(where, f"gives {shown!r} the reversed byte range [{begin:,}, {end:,})")
    if end > data_size:
        raise _corrupt(
            where,
            f"is truncated: its header needs {data_start + end:,} bytes, it has "
            f"{data_start + data_size:,}",
        )
    if _nbytes(shape, DTYPE_SIZES[dtype], limit=data_size) != end - begin:
        raise _corrupt(
            where,
            f"gives {shown!r} {end - begin:,} bytes, which is not the size of "
            f"{dtype}{_shape_text(shape)}",
        )
    return TensorInfo(
        dtype=dtype, shape=tuple(shape), offset=data_start + begin, nbytes=end - begin
    )


def _nbytes(shape: Sequence[int], item_size: int, limit: int) -> int | None:
    """Bytes of a tensor, or None once it exceeds `limit` (no huge product is built)."""
    if 0 in shape:
        return 0
    count = item_size
    for dim in shape:
        count *= dim
        if count > limit:
            return None
    return count


def _shape_text(shape: Sequence[int]) -> str:
    text = str(list(shape))
    return jsonio.shorten(text)


def _check_tiling(
    where: Path | str, tensors: Mapping[str, TensorInfo], start: int, size: int
) -> None:
    position = start
    for info in sorted(tensors.values(), key=attrgetter("offset", "nbytes")):
        if info.offset != position:
            raise _corrupt(where, "has tensors with holes or overlaps between them")
        position += info.nbytes
    if position < size:
        raise _corrupt(where, f"has {size - position:,} bytes after its last tensor")


def _corrupt(where: Path | str, what: str) -> CorruptFileError:
    return CorruptFileError(
        f"{where} {what}; it is not a valid safetensors file (re-download or re-create it)",
        path=str(where),
    )


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPE_SIZES[self.dtype]


def encode_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The header bytes (length prefix included) for tensors stored in `specs` order."""
    entries: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw
