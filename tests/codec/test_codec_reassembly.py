"""The joins that rebuild float words from their planes: the compiled (numba) and the numpy
form write the same bytes for any input, and both round-trip real files."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from codec_layouts import EARLIER_LAYOUTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from shardprep.codec import compress_file, decompress_buffer, reassembly, transforms
from shardprep.codec.stored import BF16, BF16_7, F16, F16_BYTE, F16_SIGNS
from shardprep.errors import CorruptFileError

EXAMPLES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def compiled_or_skip() -> ModuleType:
    fast = reassembly.compiled()
    if fast is None:
        pytest.skip("numba is not installed: only the numpy joins exist")
    return fast


def both_ways(join, out: np.ndarray, *args: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """`join` into two copies of `out` (at the same alignment), compiled then numpy."""
    outs = []
    try:
        for enabled in (True, False):
            reassembly.use_compiled(enabled)
            shift = out.ctypes.data % out.itemsize
            copy = np.zeros(out.nbytes + shift, np.uint8)[shift:].view(out.dtype)
            copy[:] = out
            join(copy, *args)
            outs.append(copy)
    finally:
        reassembly.use_compiled(True)
    return outs[0], outs[1]


planes = (
    st.integers(0, 64)
    .map(lambda k: 32 * k)
    .flatmap(lambda n: st.tuples(st.just(n), st.binary(min_size=2 * n, max_size=2 * n)))
)


@EXAMPLES
@given(sized=planes, base=st.integers(0, 192), unaligned=st.booleans())
def test_bf16_join_is_the_same_compiled_or_not(
    sized: tuple[int, bytes], base: int, unaligned: bool
) -> None:
    compiled_or_skip()
    n, noise = sized
    data = np.frombuffer(noise, np.uint8)
    sym, packed = data[:n], data[n : n + n // 4 * 3]
    # An output at an odd address, as a tensor after an odd-sized header lands.
    backing = np.zeros(2 * n + 1, np.uint8)
    out = backing[int(unaligned) : int(unaligned) + 2 * n].view("<u2")
    fast, slow = both_ways(reassembly.join_bf16, out, sym, packed, base)
    assert fast.tobytes() == slow.tobytes()
    fast, slow = both_ways(reassembly.join_bf16_7, out, sym, data[n : n + n // 8 * 7], base)
    assert fast.tobytes() == slow.tobytes()


@EXAMPLES
@given(sized=planes, base=st.integers(0, 192))
def test_f16_and_f32_joins_are_the_same_compiled_or_not(
    sized: tuple[int, bytes], base: int
) -> None:
    compiled_or_skip()
    n, noise = sized
    data = np.frombuffer(noise, np.uint8)
    fast, slow = both_ways(reassembly.join_f16, np.zeros(n, "<u2"), data[:n], data[n:])
    assert fast.tobytes() == slow.tobytes()
    signs = (data[n:], data[:n], data[n : n + n // 8])
    fast, slow = both_ways(reassembly.join_f16_signs, np.zeros(n, "<u2"), *signs)
    assert fast.tobytes() == slow.tobytes()
    sym, packed, low = data[:n], data[n : n + n // 4 * 3], (data[n:], data[:n])
    fast, slow = both_ways(reassembly.join_f32, np.zeros(n, "<u4"), sym, packed, base, *low)
    assert fast.tobytes() == slow.tobytes()


def test_joins_of_segments_longer_than_a_numpy_pass_are_the_same_compiled_or_not() -> None:
    compiled_or_skip()
    n = 5 * (1 << 17) + 32  # numpy joins in passes of 1 << 18 elements
    data = np.random.default_rng(1).integers(0, 256, 2 * n, dtype=np.uint8)
    sym, packed7, packed6 = data[:n], data[n : n + n // 8 * 7], data[n : n + n // 4 * 3]
    for join, args in (
        (reassembly.join_bf16_7, (sym, packed7, 90)),
        (reassembly.join_bf16, (sym, packed6, 90)),
        (reassembly.join_f16_signs, (sym, data[n:], data[: n // 8])),
    ):
        fast, slow = both_ways(join, np.zeros(n, "<u2"), *args)
        assert fast.tobytes() == slow.tobytes(), join.__name__


@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "numpy"])
def test_planes_of_other_sizes_are_refused(enabled: bool) -> None:
    reassembly.use_compiled(enabled)
    try:
        out, short = np.zeros(64, "<u2"), np.zeros(63, np.uint8)
        with pytest.raises(CorruptFileError, match="differ in size"):
            reassembly.join_bf16(out, short, np.zeros(48, np.uint8), 100)
        with pytest.raises(CorruptFileError, match="differ in size"):
            reassembly.join_bf16_7(out, np.zeros(64, np.uint8), np.zeros(48, np.uint8), 100)
        with pytest.raises(CorruptFileError, match="differ in size"):
            reassembly.join_f16(out, np.zeros(64, np.uint8), short)
        with pytest.raises(CorruptFileError, match="differ in size"):
            reassembly.join_f16_signs(out, out.view(np.uint8)[:64], short, np.zeros(8, np.uint8))
        with pytest.raises(CorruptFileError, match="differ in size"):
            reassembly.join_f32(np.zeros(64, "<u4"), short, np.zeros(48, np.uint8), 0, out, out)
    finally:
        reassembly.use_compiled(True)


def weights(dtype: torch.dtype, seed: int) -> bytes:
    """A small checkpoint: weight-like values, exact zeros, extremes, an odd-sized tensor."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(70_001, generator=generator) * 0.02
    values[:50] = torch.tensor([0.0, -0.0, 1e-30, -1e30, float("inf"), float("nan")] * 8 + [2, 3])
    return save({"w": values.to(dtype), "ln": torch.ones(384).to(dtype)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "numpy"])
def test_both_joins_round_trip_real_files(
    tmp_path: Path, dtype: torch.dtype, enabled: bool
) -> None:
    raw = weights(dtype, seed=3)
    source, stored = tmp_path / "w.safetensors", tmp_path / "w.zst"
    source.write_bytes(raw)
    compress_file(source, stored, threads=2, frame_size=65536)
    reassembly.use_compiled(enabled)
    try:
        assert decompress_buffer(stored.read_bytes(), threads=2).tobytes() == raw
    finally:
        reassembly.use_compiled(True)


@pytest.mark.parametrize("layout", sorted(EARLIER_LAYOUTS))
@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "numpy"])
def test_files_of_the_earlier_layouts_still_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool, layout: str
) -> None:
    dtype, kind, encode_as_before = EARLIER_LAYOUTS[layout]
    raw = weights(dtype, seed=5)
    source, old, new = tmp_path / "w.safetensors", tmp_path / "old.zst", tmp_path / "new.zst"
    source.write_bytes(raw)
    compress_file(source, new, threads=1, frame_size=65536)
    monkeypatch.setitem(transforms.ENCODERS, kind, encode_as_before)
    compress_file(source, old, threads=1, frame_size=65536)
    version_1 = bytearray(old.read_bytes())
    version_1[8:10] = (1).to_bytes(2, "little")  # as earlier versions wrote it
    assert version_1 != new.read_bytes()
    reassembly.use_compiled(enabled)
    try:
        assert decompress_buffer(version_1, threads=2).tobytes() == raw
        assert decompress_buffer(new.read_bytes(), threads=2).tobytes() == raw
    finally:
        reassembly.use_compiled(True)
    version_3 = bytearray(new.read_bytes())
    version_3[8:10] = (3).to_bytes(2, "little")
    with pytest.raises(CorruptFileError, match="container version 3; .* upgrade shardprep"):
        decompress_buffer(version_3)


def test_segments_of_an_unknown_layout_are_refused() -> None:
    assert transforms.plane_sizes(F16, F16_SIGNS, 128) == [64, 64, 8]
    assert transforms.plane_sizes(F16, F16_BYTE, 128) == [64, 64]
    assert transforms.plane_sizes(F16, 2, 128) is None
    assert transforms.plane_sizes(BF16_7, 100, 128) == [64, 56, -320]
    assert transforms.plane_sizes(BF16, 100, 128) == [64, 48, -320]
    assert transforms.plane_sizes(BF16_7, 193, 128) is None  # window past 255
    assert transforms.plane_sizes(BF16_7, 100, 96) is None  # not 32 elements


def test_without_numba_the_numpy_joins_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.delitem(sys.modules, "shardprep.codec.compiled", raising=False)
    reassembly.use_compiled(True)
    try:
        assert reassembly.compiled() is None
        raw = weights(torch.bfloat16, seed=4)
        source, stored = tmp_path / "w.safetensors", tmp_path / "w.zst"
        source.write_bytes(raw)
        compress_file(source, stored, threads=1)
        assert decompress_buffer(stored.read_bytes(), threads=2).tobytes() == raw
    finally:
        reassembly.use_compiled(True)


def test_a_numba_that_fails_falls_back_to_numpy_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(name: str) -> ModuleType:
        raise RuntimeError("cannot cache function 'join_bf16': no locator available")

    monkeypatch.setattr(reassembly.importlib, "import_module", broken)
    reassembly.use_compiled(True)
    try:
        with caplog.at_level("WARNING", logger="shardprep.codec"):
            assert reassembly.compiled() is None
        assert "Decoding with numpy: numba could not compile the joins" in caplog.text
        out = np.zeros(32, "<u2")
        reassembly.join_f16(out, np.ones(32, np.uint8), np.full(32, 0x81, np.uint8))
        assert set(out.tolist()) == {0x8000 | 1 << 7 | 1}
    finally:
        reassembly.use_compiled(True)


def test_a_compile_that_takes_long_is_announced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiled_or_skip()
    # Imported again: numba loads the machine code from its cache, which takes longer than
    # a notice due at once.
    monkeypatch.delitem(sys.modules, "shardprep.codec.compiled")
    monkeypatch.setattr(reassembly, "COMPILE_NOTICE_S", 0.0)
    reassembly.use_compiled(True)
    try:
        with caplog.at_level("WARNING", logger="shardprep.codec"):
            assert reassembly.compiled() is not None
        assert "Compiling the codec's decoder with numba (once per installation" in caplog.text
        caplog.clear()
        monkeypatch.delitem(sys.modules, "shardprep.codec.compiled")
        monkeypatch.setattr(reassembly, "COMPILE_NOTICE_S", 60.0)
        reassembly.use_compiled(True)
        with caplog.at_level("WARNING", logger="shardprep.codec"):
            assert reassembly.compiled() is not None
        assert "Compiling" not in caplog.text
        for timer in [t for t in threading.enumerate() if isinstance(t, threading.Timer)]:
            timer.join(timeout=5)  # cancelled: ends at once, not in a minute
            assert not timer.is_alive()
    finally:
        reassembly.use_compiled(True)
