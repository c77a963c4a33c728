"""A strict safetensors header parser and a streaming writer.

safetensors itself has no streaming writer (`save_file` needs every tensor in memory),
so the writer builds the header from the plan, then takes each tensor's bytes in order,
hashing as it goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardprep.constants import INCOMPLETE_SUFFIX, MAX_HEADER_BYTES
from shardprep.errors import CorruptFileError

DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# The torch dtype of each (an attribute of `torch`, looked up only where torch is used).
TORCH_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in a safetensors file (`offset` is absolute)."""

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
    """Parse and check a safetensors header: size limit first, then that the tensors
    tile the data area exactly, with no hole, overlap or trailing byte."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, "is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise _corrupt(
                path, f"declares a {length:,}-byte header, over the {MAX_HEADER_BYTES:,} limit"
            )
        if 8 + length > file_size:
            raise _corrupt(path, "is truncated inside its header")
        raw = f.read(length)
    try:
        entries = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, f"has a header that is not JSON ({exc})") from None
    if not isinstance(entries, dict):
        raise _corrupt(path, "has a header that is not a JSON object")
    metadata = entries.pop("__metadata__", None) or {}
    data_start = 8 + length
    tensors = {name: _tensor_info(path, name, entry, data_start) for name, entry in entries.items()}
    _check_tiling(path, tensors, data_start, file_size)
    return Header(tensors=tensors, metadata=metadata, data_start=data_start, file_size=file_size)


def _tensor_info(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]  # type: ignore[index]
        shape = tuple(int(d) for d in shape)
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"has a malformed header entry for {name!r}") from None
    if dtype not in DTYPE_SIZES:
        raise _corrupt(path, f"uses dtype {dtype!r} for {name!r}, which shardprep does not know")
    if end - begin != numel(shape) * DTYPE_SIZES[dtype] or begin < 0:
        raise _corrupt(path, f"gives {name!r} a byte range that does not match its shape")
    return TensorInfo(dtype=dtype, shape=shape, offset=data_start + begin, nbytes=end - begin)


def _check_tiling(path: Path, tensors: Mapping[str, TensorInfo], start: int, size: int) -> None:
    position = start
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if info.offset != position:
            raise _corrupt(path, "has tensors with holes or overlaps between them")
        position += info.nbytes
    if position > size:
        raise _corrupt(path, f"is truncated: its header needs {position:,} bytes, it has {size:,}")
    if position < size:
        raise _corrupt(path, f"has {size - position:,} bytes after its last tensor")


def _corrupt(path: Path, what: str) -> CorruptFileError:
    return CorruptFileError(
        f"{path} {what}; it is not a valid safetensors file (re-download or re-create it)",
        path=str(path),
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


class StreamingWriter:
    """Writes one safetensors file tensor by tensor to `<path>.incomplete`, hashing as
    it goes; `commit()` checks the byte count and renames it into place."""

    def __init__(
        self, path: Path, specs: Sequence[TensorSpec], metadata: Mapping[str, str]
    ) -> None:
        self.path = path
        self.tmp_path = path.with_name(path.name + INCOMPLETE_SUFFIX)
        header = encode_header(specs, metadata)
        self.expected_size = len(header) + sum(spec.nbytes for spec in specs)
        self.sha256 = hashlib.sha256()
        self.size = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.tmp_path, "wb")  # noqa: SIM115 - closed in commit/abort
        self.write(header)

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def commit(self) -> str:
        """Close, check, rename into place; returns the sha256 hex digest."""
        self._file.close()
        if self.size != self.expected_size:
            self.tmp_path.unlink(missing_ok=True)
            raise CorruptFileError(
                f"internal error: wrote {self.size:,} bytes to {self.path}, "
                f"expected {self.expected_size:,}",
                path=str(self.path),
            )
        os.replace(self.tmp_path, self.path)
        return self.sha256.hexdigest()

    def abort(self) -> None:
        self._file.close()
        self.tmp_path.unlink(missing_ok=True)


def sha256_file(path: Path, chunk: int = 16 * 1024**2) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
