"""Property-based tests of the codec's decoder and container parser (hypothesis).

Any byte string, and any mutation of a valid container, gives back the original bytes or a
ShardprepError, never another exception, within a time limit and a memory bound that
depend on the frame size only; any safetensors file of any dtype round-trips exactly.
"""

from __future__ import annotations

import hashlib
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hostile import safetensors_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardprep.codec import compress_file, decompress_buffer, decompress_file, reassembly
from shardprep.codec.container import FILE_HEADER, MAGIC
from shardprep.errors import ShardprepError
from shardprep.format.dtypes import DTYPE_SIZES

SECONDS_PER_EXAMPLE = 10
FUZZ = settings(
    max_examples=150,
    deadline=None,  # timed below, with a bound that a loaded CI machine keeps
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(autouse=True, scope="module")
def compiled_joins_ready() -> None:
    """With numba, the joins and the frame decoder compile (or load from its cache) once,
    here: not inside an example that is timed and whose memory is traced."""
    reassembly.compiled()
    reassembly.frame_decoder()


# ---------------------------------------------------------------------------- inputs


@st.composite
def tensor_data(draw: st.DrawFn, dtype: str) -> tuple[list[int], bytes]:
    """Random bytes (NaN, inf, subnormals included) or weight-like values of `dtype`."""
    shape = draw(st.lists(st.integers(0, 700), min_size=1, max_size=2))
    count = int(np.prod(shape))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if dtype in ("BF16", "F16", "F32", "F64") and draw(st.booleans()):
        values = rng.standard_normal(count).astype(np.float32) * draw(st.sampled_from([0.02, 1.0]))
        if dtype == "BF16":
            raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            raw = values.astype({"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype]).tobytes()
    else:
        raw = rng.integers(0, 256, count * DTYPE_SIZES[dtype], dtype=np.uint8).tobytes()
    return shape, raw


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    dtypes = draw(st.lists(st.sampled_from(sorted(DTYPE_SIZES)), min_size=1, max_size=6))
    tensors = []
    for i, dtype in enumerate(dtypes):
        shape, raw = draw(tensor_data(dtype))
        tensors.append((f"t{i}", dtype, shape, raw))
    return safetensors_bytes(tensors)


def valid_container(tmp: Path, raw: bytes, frame_size: int) -> bytes:
    source, stored = tmp / "source.safetensors", tmp / "source.zst"
    source.write_bytes(raw)
    compress_file(source, stored, threads=2, frame_size=frame_size)
    return stored.read_bytes()


@st.composite
def mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """Flipped bits, overwritten runs, cuts, insertions, deleted or repeated spans."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(
            st.sampled_from(["flip", "overwrite", "truncate", "insert", "delete", "repeat"])
        )
        pos = draw(st.integers(0, max(0, len(out) - 1)))
        span = draw(st.integers(1, 64))
        if kind == "flip" and out:
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            out[pos : pos + span] = draw(st.binary(min_size=span, max_size=span))
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=span))
        elif kind == "delete":
            del out[pos : pos + span]
        else:
            out[pos:pos] = out[pos : pos + span * 64]
    return bytes(out)


def headed_noise() -> st.SearchStrategy[bytes]:
    """A container header with any frame size and claimed size, then noise."""
    return st.builds(
        lambda frame_size, raw_size, rest: (
            FILE_HEADER.pack(MAGIC, 1, 0, frame_size, raw_size) + rest
        ),
        st.one_of(st.integers(4096, 1 << 16), st.integers(0, 2**32 - 1)),
        st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1)),
        st.binary(max_size=3000),
    )


# ---------------------------------------------------------------------------- checks


def claimed_frame_size(data: bytes) -> int:
    if data.startswith(MAGIC) and len(data) >= FILE_HEADER.size:
        return FILE_HEADER.unpack_from(data)[3]
    return 0


def assert_original_or_refused(tmp: Path, data: bytes, original: bytes | None) -> None:
    """Both entry points give `original` back or raise a ShardprepError, in bounded time
    and with traced memory bounded by a few frames (never by a claimed total size)."""
    stored, out = tmp / "candidate.zst", tmp / "restored.safetensors"
    stored.write_bytes(data)
    out.unlink(missing_ok=True)
    frame = min(claimed_frame_size(data), 256 * 1024**2)
    bound = 16 * frame + 8 * len(data) + 32 * 1024**2
    tracemalloc.start()
    started = time.monotonic()
    try:
        try:
            result = decompress_file(stored, out, threads=2)
        except ShardprepError:
            assert not out.exists()
        else:
            restored = out.read_bytes()
            assert original is None or restored == original
            assert result.raw_sha256 == hashlib.sha256(restored).hexdigest()
        # decompress_buffer reserves its whole output untouched (np.empty: no page is used
        # until a frame is written), which tracemalloc would count; the bound is for files.
        _, peak = tracemalloc.get_traced_memory()
        try:
            array = decompress_buffer(data, threads=2)
        except ShardprepError:
            pass
        else:
            assert original is None or array.tobytes() == original
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < SECONDS_PER_EXAMPLE
    if data.startswith(MAGIC):  # a "none" file is copied whole: its size is its bound
        assert peak < bound, (peak, bound)
    assert not list(tmp.glob("*.incomplete"))


# ---------------------------------------------------------------------------- properties


@FUZZ
@given(data=st.one_of(st.binary(max_size=4000), headed_noise()))
def test_any_bytes_decode_or_are_refused(tmp_path: Path, data: bytes) -> None:
    assert_original_or_refused(tmp_path, data, None)


@pytest.fixture(scope="module")
def valid_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A file of every dtype in 4 KiB frames: many frames, segments and stream kinds."""
    rng = np.random.default_rng(7)
    tensors = []
    for i, dtype in enumerate(sorted(DTYPE_SIZES)):
        count = 3000 + i
        if dtype in ("BF16", "F32"):
            values = (rng.standard_normal(count) * 0.02).astype(np.float32)
            raw = values.tobytes() if dtype == "F32" else (values.view(np.uint32) >> 16)
            raw = raw if isinstance(raw, bytes) else raw.astype("<u2").tobytes()
        else:
            raw = rng.integers(0, 256, count * DTYPE_SIZES[dtype], dtype=np.uint8).tobytes()
        tensors.append((f"t{i}", dtype, [count], raw))
    original = safetensors_bytes(tensors)
    tmp = tmp_path_factory.mktemp("valid-container")
    return original, valid_container(tmp, original, frame_size=4096)


@FUZZ
@given(seed=st.data())
def test_mutated_containers_restore_the_original_or_are_refused(
    tmp_path: Path, valid_sample: tuple[bytes, bytes], seed: st.DataObject
) -> None:
    original, stored = valid_sample
    damaged = seed.draw(mutations(stored))
    expect = original if damaged.startswith(MAGIC) else None  # else it is a plain copy
    assert_original_or_refused(tmp_path, damaged, expect)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=safetensors_files(), frame_size=st.sampled_from([4096, 5000, 65536, 4 * 1024**2]))
def test_every_dtype_round_trips(raw: bytes, frame_size: int, tmp_path_factory) -> None:
    tmp = tmp_path_factory.mktemp("round-trip")
    stored = valid_container(tmp, raw, frame_size)
    assert decompress_buffer(stored, threads=2).tobytes() == raw
    back = tmp / "back.safetensors"
    result = decompress_file(tmp / "source.zst", back, threads=1, expected_bytes=len(raw))
    assert back.read_bytes() == raw
    assert result.raw_sha256 == hashlib.sha256(raw).hexdigest()
