"""A frame decoded in one compiled call (`compiled.decode_frame`: numba and the system's
libzstd) holds the same bytes as the frame decoded stream by stream through `transforms`;
a damaged frame is handed back to the latter, which says what is wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from codec_layouts import EARLIER_LAYOUTS
from hostile import safetensors_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from shardprep.codec import compress_file, container, decompress_buffer, libzstd, reassembly
from shardprep.codec import transforms as tf
from shardprep.codec.stored import BF16_7, ZSTD
from shardprep.errors import CorruptFileError
from shardprep.format.dtypes import DTYPE_SIZES


def native_or_skip() -> Callable[..., bool]:
    decoder = reassembly.frame_decoder()
    if decoder is None:
        pytest.skip("needs numba and a system libzstd (1.4 or later)")
    return decoder


@pytest.fixture(autouse=True)
def compiled_frames_on() -> Iterator[None]:
    reassembly.use_compiled(True)
    yield
    reassembly.use_compiled(True)


def stored(tmp: Path, raw: bytes, frame_size: int) -> bytes:
    source, target = tmp / "source.safetensors", tmp / "source.zst"
    source.write_bytes(raw)
    compress_file(source, target, threads=1, frame_size=frame_size)
    return target.read_bytes()


def frames(data: bytes) -> list[container.Frame]:
    view, position = memoryview(data), 0

    def read(size: int) -> memoryview:
        nonlocal position
        position += size
        return view[position - size : position]

    box = container.Container(read)
    found = list(box)
    box.finish()
    return found


def both_ways(frame: container.Frame) -> tuple[bool, bytes, bytes]:
    """(accepted, bytes) of the compiled call, and the bytes of the stream-by-stream path."""
    fast, slow = np.zeros(frame.raw_len, np.uint8), np.zeros(frame.raw_len, np.uint8)
    accepted = native_or_skip()(frame, fast)
    reassembly.use_compiled(True, frames=False)
    try:
        container.decode_frame(frame, slow)
    finally:
        reassembly.use_compiled(True)
    return accepted, fast.tobytes(), slow.tobytes()


FLOATS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "BF16": lambda values: (values.view(np.uint32) >> 16).astype("<u2"),
    "F16": lambda values: values.astype("<f2"),
    "F32": lambda values: values.astype("<f4"),
}


@st.composite
def checkpoints(draw: st.DrawFn) -> bytes:
    """Tensors of any dtype: weight-like floats, or noise (which makes BF16 and F32 fall
    back to byte planes), odd counts so that frames cut elements."""
    tensors = []
    for i, dtype in enumerate(draw(st.lists(st.sampled_from(sorted(DTYPE_SIZES)), max_size=5))):
        count = draw(st.integers(0, 9000))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        if dtype in FLOATS and draw(st.booleans()):
            values = rng.standard_normal(count).astype(np.float32) * np.float32(0.02)
            data = FLOATS[dtype](values).tobytes()
        else:
            data = rng.integers(0, 256, count * DTYPE_SIZES[dtype], dtype=np.uint8).tobytes()
        tensors.append((f"t{i}", dtype, [count], data))
    return safetensors_bytes(tensors)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=checkpoints(), frame_size=st.sampled_from([4096, 5000, 65536]))
def test_every_frame_decodes_the_same_in_one_call(
    raw: bytes, frame_size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    native_or_skip()
    data = stored(tmp_path_factory.mktemp("frames"), raw, frame_size)
    for frame in frames(data):
        accepted, fast, slow = both_ways(frame)
        assert accepted and fast == slow == raw[frame.start : frame.start + frame.raw_len]


def weights(dtype: torch.dtype) -> bytes:
    values = torch.randn(70_001, generator=torch.Generator().manual_seed(2)) * 0.02
    values[:40] = torch.tensor([0.0, -0.0, 1e-30, -1e30, float("inf"), float("nan"), 2, 3] * 5)
    return save({"w": values.to(dtype), "zeros": torch.zeros(5000, dtype=dtype)})


@pytest.mark.parametrize(
    ("dtype", "kind", "encoder"),
    [
        (torch.bfloat16, None, None),
        (torch.float16, None, None),
        (torch.float32, None, None),
        EARLIER_LAYOUTS["bf16"],
        EARLIER_LAYOUTS["f16"],
    ],
    ids=["bf16", "f16", "f32", "bf16-earlier", "f16-earlier"],
)
def test_weights_with_escapes_and_zeros_decode_the_same_in_one_call(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    kind: int | None,
    encoder: Callable[[memoryview, int], tf.Encoded] | None,
) -> None:
    native_or_skip()
    if kind is not None:
        monkeypatch.setitem(tf.ENCODERS, kind, encoder)
    raw = weights(dtype)
    data = stored(tmp_path, raw, frame_size=1 << 20)  # segments longer than a numpy pass
    kinds = set()
    for frame in frames(data):
        kinds |= {segment_kind for segment_kind, _, _ in frame.segments}
        accepted, fast, slow = both_ways(frame)
        assert accepted and fast == slow
    assert decompress_buffer(data).tobytes() == raw
    assert len(kinds) >= 2  # the weights' own kind and PLAIN at least


def a_zstd_stream(data: bytes, frame: container.Frame) -> tuple[int, int]:
    """(index, offset in `data`) of the frame's first zstd stream after stream 0."""
    payload = np.frombuffer(frame.payload, np.uint8).ctypes.data
    offset = payload - np.frombuffer(data, np.uint8).ctypes.data + frame.streams[0][2]
    for i, (method, _, size) in enumerate(frame.streams[1:], start=1):
        if method == ZSTD:
            return i, offset
        offset += size
    raise AssertionError("no zstd stream")


def test_a_damaged_stream_is_handed_back_and_named(tmp_path: Path) -> None:
    native = native_or_skip()
    raw = weights(torch.bfloat16)
    intact = stored(tmp_path, raw, frame_size=65536)
    index, offset = a_zstd_stream(intact, frames(intact)[1])
    data = bytearray(intact)
    data[offset : offset + 4] = bytes(4)  # zstd's magic number
    damaged = frames(bytes(data))[1]
    assert not native(damaged, np.zeros(damaged.raw_len, np.uint8))
    with pytest.raises(CorruptFileError, match=f"frame 1, stream {index}"):
        decompress_buffer(bytes(data))


def test_an_escape_outside_its_segment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = native_or_skip()
    encode = tf.ENCODERS[BF16_7]

    def escape_too_far(data: memoryview, item: int) -> tf.Encoded:
        kind, base, planes, lz = encode(data, item)
        count = len(data) // 2
        planes[2] = np.frombuffer(count.to_bytes(4, "little") + bytes([base]), np.uint8)
        return kind, base, planes, lz

    monkeypatch.setitem(tf.ENCODERS, BF16_7, escape_too_far)
    data = stored(tmp_path, weights(torch.bfloat16), frame_size=65536)
    frame = frames(data)[1]
    assert not native(frame, np.zeros(frame.raw_len, np.uint8))
    with pytest.raises(CorruptFileError, match="an escape points outside its segment"):
        decompress_buffer(data)


def test_without_a_system_libzstd_frames_decode_stream_by_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(libzstd, "_NAMES", ())
    monkeypatch.setattr(libzstd.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(libzstd, "_found", False)
    reassembly.use_compiled(True)
    assert libzstd.library() is None
    assert reassembly.frame_decoder() is None
    raw = weights(torch.bfloat16)
    assert decompress_buffer(stored(tmp_path, raw, frame_size=65536)).tobytes() == raw


def test_the_system_libzstd_is_new_enough_where_found() -> None:
    lib = libzstd.library()
    if lib is None:
        pytest.skip("no system libzstd here")
    assert lib.version >= libzstd.MIN_VERSION
    assert libzstd.thread_context(lib) == libzstd.thread_context(lib) != 0
