"""The strict header parser: whatever the bytes, a checked header or a CorruptFileError.

Random bytes rarely get past the length prefix, so most examples start from a valid file
and break one thing in it (a field set to another JSON value, offsets swapped, bytes cut or
added, a key repeated); whatever the parser accepts must also load in the safetensors
library with the same shapes. Each example runs under a deadline and tracemalloc.
"""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import safetensors
from hostile import pack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardprep.errors import CorruptFileError, ShardprepError
from shardprep.format.dtypes import DTYPE_SIZES
from shardprep.format.headers import Header, numel, parse_header, read_header

FUZZ = settings(
    max_examples=150,
    deadline=10_000,  # generous: CI machines are shared; a runaway parse still fails
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

JUNK = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 2**40), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def valid_files(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A valid header (tensors stored in a random order) and its data."""
    names = draw(st.lists(st.text("abc.", min_size=1, max_size=4), max_size=4, unique=True))
    specs = [
        (
            name,
            draw(st.sampled_from(sorted(DTYPE_SIZES))),
            draw(st.lists(st.integers(0, 4), max_size=3)),
        )
        for name in names
    ]
    order = draw(st.permutations(specs))
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in order:
        size = numel(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=3), st.text(max_size=3)))
    return header, draw(st.binary(min_size=offset, max_size=offset))


@st.composite
def near_valid(draw: st.DrawFn) -> bytes:
    header, data = draw(valid_files())
    names = [n for n in header if n != "__metadata__"]
    kind = draw(
        st.sampled_from(
            ["field", "item", "swap", "key", "entry", "metadata", "data", "prefix", "dup", "byte"]
        )
    )
    if kind in ("field", "item", "swap", "key", "entry") and names:
        entry = header[draw(st.sampled_from(names))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        if kind == "field":
            entry[field] = draw(JUNK)
        elif kind == "item" and field != "dtype" and entry[field]:
            entry[field][draw(st.integers(0, len(entry[field]) - 1))] = draw(JUNK)
        elif kind == "swap":
            entry["data_offsets"].reverse()
        elif kind == "key":
            entry.pop(field) if draw(st.booleans()) else entry.update(extra=draw(JUNK))
        else:
            header[draw(st.sampled_from(names))] = draw(JUNK)
    elif kind == "metadata":
        header["__metadata__"] = draw(JUNK)
    elif kind == "data":
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] if draw(st.booleans()) else data + bytes(draw(st.integers(1, 9)))
    blob = pack(header, data)
    if kind == "dup" and names:
        name = json.dumps(draw(st.sampled_from(names)))
        raw = json.dumps(header)
        raw = raw[:-1] + f", {name}: {json.dumps(header[json.loads(name)])}" + "}"
        blob = pack(raw, data)
    elif kind == "prefix":
        length = struct.unpack("<Q", blob[:8])[0] + draw(st.integers(-8, 8))
        blob = struct.pack("<Q", max(length, 0)) + blob[8:]
    elif kind == "byte" and len(blob) > 8:
        at = draw(st.integers(0, len(blob) - 1))
        blob = blob[:at] + bytes([blob[at] ^ draw(st.integers(1, 255))]) + blob[at + 1 :]
    return blob


def parse_bounded(blob: bytes) -> Header | None:
    """parse_header's answer, with the memory it took checked: None for a refusal."""
    tracemalloc.start()
    try:
        header = parse_header(blob)
    except ShardprepError:
        header = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1024**2 + 200 * len(blob), peak
    return header


def check_accepted(blob: bytes, header: Header) -> None:
    """What an accepted header promises, and the safetensors library agrees."""
    position = header.data_start
    for info in sorted(header.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        assert all(type(d) is int and d >= 0 for d in info.shape)
        assert info.nbytes == numel(info.shape) * DTYPE_SIZES[info.dtype]
        assert info.offset == position
        position += info.nbytes
    assert position == header.file_size == len(blob)
    # the library's own reader (its torch front end knows no F8_E8M0 in every version)
    loaded = dict(safetensors.deserialize(blob))
    assert {n: (t["dtype"], tuple(t["shape"])) for n, t in loaded.items()} == {
        n: (info.dtype, info.shape) for n, info in header.tensors.items()
    }


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_give_a_header_or_a_corrupt_file_error(blob: bytes) -> None:
    header = parse_bounded(blob)
    if header is not None:
        check_accepted(blob, header)


@FUZZ
@given(valid_files())
def test_valid_files_are_accepted_as_safetensors_reads_them(file: tuple[dict, bytes]) -> None:
    blob = pack(*file)
    header = parse_bounded(blob)
    assert header is not None
    check_accepted(blob, header)


@FUZZ
@given(near_valid())
def test_near_valid_files_give_a_header_or_a_corrupt_file_error(blob: bytes) -> None:
    header = parse_bounded(blob)
    if header is not None:
        check_accepted(blob, header)


def entry(dtype: str, shape: list[Any], offsets: list[Any]) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        # the bypass: a negative dimension and reversed offsets whose difference "matched"
        ({"w": entry("F32", [-1, 4], [16, 0])}, b"", "a shape that is not a list of integers"),
        ({"w": entry("F32", [4], [16, 0])}, bytes(16), "the reversed byte range [16, 0)"),
        ({"w": entry("F32", [True, 4], [0, 16])}, bytes(16), "not a list of integers >= 0"),
        ({"w": entry("F32", [4.0], [0, 16])}, bytes(16), "not a list of integers >= 0"),
        ({"w": entry("F32", [4], [0.0, 16.0])}, bytes(16), "data_offsets that are not two"),
        ({"w": entry("F32", [4], ["0", "16"])}, bytes(16), "data_offsets that are not two"),
        ({"w": entry("F32", [4], [0, 16, 32])}, bytes(16), "data_offsets that are not two"),
        ({"w": entry("F32", [4], [0, 12])}, bytes(12), "12 bytes, which is not the size of F32[4]"),
        ({"w": entry("F32", [2**62, 2**62], [0, 16])}, bytes(16), "which is not the size of"),
        ({"w": entry("Q4", [4], [0, 4])}, bytes(4), "uses dtype 'Q4' for 'w'"),
        (
            {"w": entry("F32", [1], [0, 4]), "v": entry("F32", [1], [0, 4])},
            bytes(8),
            "holes or overlaps",
        ),
        ({"w": entry("F32", [1], [4, 8])}, bytes(8), "holes or overlaps"),
        ({"w": entry("F32", [1], [0, 4])}, bytes(8), "4 bytes after its last tensor"),
        ({"w": entry("F32", [4], [0, 16])}, bytes(8), "is truncated: its header needs"),
        ({"w": [4]}, b"", "not {dtype, shape, data_offsets}"),
        ({"w": {**entry("F32", [1], [0, 4]), "x": 1}}, bytes(4), "not {dtype, shape, data_off"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__ that is not a map of strings"),
        ([], b"", "header that is not a JSON object"),
    ],
)
def test_each_flaw_is_named(header: Any, data: bytes, message: str) -> None:
    raw = json.dumps(header).encode()
    with pytest.raises(CorruptFileError) as info:
        parse_header(struct.pack("<Q", len(raw)) + raw + data)
    assert message in str(info.value)
    assert str(info.value).endswith(
        "it is not a valid safetensors file (re-download or re-create it)"
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
        ('{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}', "parse"),
        ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, NaN]}}', "holds NaN"),
        ('{"w": 1, "w": 2}', "names the key 'w' twice"),
        ('{"\\ud800": 1}', "lone surrogate"),
        ("{}".encode("utf-16"), "is not UTF-8"),
        (b"{\xff}", "is not UTF-8"),
    ],
)
def test_hostile_json_is_refused_quickly(raw: str | bytes, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(CorruptFileError, match="header that is not JSON: it ") as info:
        parse_header(pack(raw))
    assert message in str(info.value)
    assert time.monotonic() - started < 2


def test_a_huge_declared_header_is_refused_before_reading(tmp_path: Path) -> None:
    for length, message in ((2**64 - 1, "over the 100,000,000 limit"), (99_999_999, "truncated")):
        path = tmp_path / "claims.safetensors"
        path.write_bytes(struct.pack("<Q", length) + b"{}")
        tracemalloc.start()
        with pytest.raises(CorruptFileError, match=message):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 256 * 1024


def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CorruptFileError, match="is not a regular file"):
        read_header(fifo)


def test_read_header_and_parse_header_agree(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    raw = pack({"b": entry("BF16", [2, 1], [4, 8]), "a": entry("F32", [1], [0, 4])}, bytes(8))
    path.write_bytes(raw)
    header = read_header(path)
    assert header == parse_header(raw, where=str(path))
    assert header.tensors["b"].offset == header.data_start + 4
