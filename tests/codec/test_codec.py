"""Transport codec: byte-exact round trips on real safetensors bytes, ratio, damage, determinism."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from codec_bombs import FRAME_SIZE, bomb
from hostile import safetensors_bytes
from safetensors.torch import save_file

from shardprep.codec import CodecResult, codec_names, compress_file, decompress_file
from shardprep.errors import ConfigError, CorruptFileError

SMALL_FRAME = 64 * 1024  # tensors below cross frame edges


def weights(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 0.02).to(dtype)


def round_trip(src: Path, **options: object) -> tuple[CodecResult, CodecResult, Path]:
    """Compress and decompress `src`; assert the bytes come back and the results agree."""
    stored, back = src.with_suffix(".spz"), src.with_suffix(".back")
    packed = compress_file(src, stored, **options)  # type: ignore[arg-type]
    threads = options.get("threads")
    unpacked = decompress_file(stored, back, threads=threads)  # type: ignore[arg-type]
    original = src.read_bytes()
    assert back.read_bytes() == original
    assert packed == unpacked
    assert packed.raw_bytes == len(original)
    assert packed.raw_sha256 == hashlib.sha256(original).hexdigest()
    assert packed.stored_bytes == stored.stat().st_size
    assert packed.stored_sha256 == hashlib.sha256(stored.read_bytes()).hexdigest()
    return packed, unpacked, stored


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]]) -> Path:
    path.write_bytes(safetensors_bytes(tensors))
    return path


def raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_round_trip_per_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "crosses_frames": weights((517, 129), dtype),  # 66,693 elements: 2-5 frames
            "small": weights((7, 3), dtype, seed=1),  # under 4 KiB: the plain stream
            "empty": torch.zeros((0, 16), dtype=dtype),
            "also_empty": torch.zeros((0,), dtype=dtype),
        },
        path,
    )
    for threads in (1, 2):
        round_trip(path, frame_size=SMALL_FRAME, threads=threads)
    round_trip(path)  # default frame size: one frame


def test_round_trip_mixed_dtypes_and_odd_offsets(tmp_path: Path) -> None:
    wide = weights((40_000,), torch.float32)
    wide[::97] = torch.tensor([0.0, -0.0, 1e-30, 3e38, float("inf"), float("nan"), 1e-40])[
        torch.arange(wide[::97].numel()) % 7
    ]  # outside any 63-binade window: escapes
    zeros = torch.zeros(30_000, dtype=torch.bfloat16)
    zeros[::5] = weights((6_000,), torch.bfloat16)  # 80 % zeros: stored as byte planes
    path = write_safetensors(
        tmp_path / "mixed.safetensors",
        [
            ("odd", "U8", [3], b"\x01\x02\x03"),  # everything after starts at an odd offset
            ("bf16", "BF16", [50_001], raw_bytes(weights((50_001,), torch.bfloat16))),
            ("escapes_bf16", "BF16", [40_000], raw_bytes(wide.to(torch.bfloat16))),
            ("escapes_f32", "F32", [40_000], raw_bytes(wide)),
            ("zeros", "BF16", [30_000], raw_bytes(zeros)),
            ("f16", "F16", [30_001], raw_bytes(weights((30_001,), torch.float16))),
            ("fp8", "F8_E4M3", [20_001], raw_bytes(weights((20_001,), torch.float8_e4m3fn))),
            ("ids", "I64", [5_000], raw_bytes(torch.arange(5_000))),
            ("mask", "BOOL", [999], raw_bytes(torch.arange(999) % 3 == 0)),
            ("empty", "BF16", [0], b""),
        ],
    )
    for frame_size in (SMALL_FRAME, SMALL_FRAME + 5, 4096):
        round_trip(path, frame_size=frame_size, threads=2)
    round_trip(path)


def test_header_only_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    save_file({}, path, metadata={"format": "pt"})
    round_trip(path)


def test_bf16_weights_compress_at_least_1_3x(tmp_path: Path) -> None:
    path = tmp_path / "bf16.safetensors"
    save_file({f"w{i}": weights((1024, 512), torch.bfloat16, seed=i) for i in range(4)}, path)
    packed, _, _ = round_trip(path)
    assert packed.raw_bytes / packed.stored_bytes >= 1.3


def test_threads_do_not_change_the_output(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "a": weights((300, 500), torch.bfloat16),
            "b": weights((200, 301), torch.float32),
            "c": weights((100, 99), torch.float16),
        },
        path,
    )
    serial, parallel = tmp_path / "serial.spz", tmp_path / "parallel.spz"
    compress_file(path, serial, threads=1, frame_size=SMALL_FRAME)
    compress_file(path, parallel, threads=2, frame_size=SMALL_FRAME)
    assert serial.read_bytes() == parallel.read_bytes()


# ---------------------------------------------------------------------------- damage


def frames_of(stored: bytes) -> list[tuple[int, int, int]]:
    """(start, payload start, end) of each frame, read as the module docstring describes."""
    frames, pos = [], 24
    while stored[pos : pos + 4] == b"SPFR":
        _, _, n_segments, n_streams = struct.unpack_from("<4sIII", stored, pos)
        tables = pos + 16
        payload = tables + 8 * n_segments + 12 * n_streams
        streams = struct.iter_unpack("<B3xII", stored[payload - 12 * n_streams : payload])
        end = payload + sum(stored_len for _, _, stored_len in streams)
        frames.append((pos, payload, end))
        pos = end
    return frames


@pytest.fixture
def stored_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(
        {"w": weights((256, 512), torch.bfloat16), "b": weights((4096,), torch.float32)}, path
    )
    compress_file(path, tmp_path / "model.spz", frame_size=SMALL_FRAME)
    return tmp_path / "model.spz"


def assert_refused(stored: Path, data: bytes) -> CorruptFileError:
    damaged = stored.with_name("damaged.spz")
    damaged.write_bytes(data)
    out = stored.with_name("out.safetensors")
    with pytest.raises(CorruptFileError) as caught:
        decompress_file(damaged, out, threads=2)
    assert caught.value.path == str(damaged)
    assert "Fetch or compress it again" in str(caught.value)
    assert not out.exists()
    assert not list(stored.parent.glob("*.incomplete"))
    return caught.value


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
def test_corrupt_frame_payload_is_detected(stored_file: Path, where: str) -> None:
    data = bytearray(stored_file.read_bytes())
    frames = frames_of(bytes(data))
    assert len(frames) >= 3
    _, payload, end = frames[1]
    pos = {"first byte": payload, "middle": (payload + end) // 2, "last byte": end - 1}[where]
    data[pos] ^= 0x10
    assert_refused(stored_file, bytes(data))


def test_corrupt_tables_and_trailer_are_detected(stored_file: Path) -> None:
    data = stored_file.read_bytes()
    start, payload, _ = frames_of(data)[0]
    for pos in (start, start + 4, payload - 4, len(data) - 1, len(data) - 40):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        assert_refused(stored_file, bytes(damaged))


def test_truncation_is_detected(stored_file: Path) -> None:
    data = stored_file.read_bytes()
    start, payload, end = frames_of(data)[1]
    for size in (0, 7, 24, start + 10, payload + 3, end, len(data) - 56, len(data) - 1):
        error = assert_refused(stored_file, data[:size])
        assert any(why in str(error) for why in ("truncated", "neither", "bytes can hold"))


def test_trailing_bytes_are_refused(stored_file: Path) -> None:
    error = assert_refused(stored_file, stored_file.read_bytes() + b"\0")
    assert "after the trailer" in str(error)


# ---------------------------------------------------------------------------- options


def test_none_codec_is_the_identity(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": weights((64, 64), torch.bfloat16)}, path)
    packed, _, stored = round_trip(path, codec="none")
    assert stored.read_bytes() == path.read_bytes()
    assert packed.raw_sha256 == packed.stored_sha256
    assert codec_names() == ["none", "zstd"]


def test_bad_options_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": weights((4, 4), torch.bfloat16)}, path)
    with pytest.raises(ConfigError, match=r"Unknown codec 'lz4'; choose one of: none, zstd\."):
        compress_file(path, tmp_path / "x", codec="lz4")
    with pytest.raises(ConfigError, match="frame_size=100 is out of range"):
        compress_file(path, tmp_path / "x", frame_size=100)
    with pytest.raises(ConfigError, match="threads=0"):
        compress_file(path, tmp_path / "x", threads=0)
    assert not (tmp_path / "x").exists()


def test_not_safetensors_is_refused(tmp_path: Path) -> None:
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(CorruptFileError, match=r"huge\.safetensors .*100,000,001-byte header"):
        compress_file(huge, tmp_path / "out")
    not_json = tmp_path / "bad.safetensors"
    not_json.write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(CorruptFileError, match=r"bad\.safetensors .*not JSON"):
        compress_file(not_json, tmp_path / "out")
    outside = write_safetensors(tmp_path / "outside.safetensors", [("w", "BF16", [2], b"1234")])
    data = outside.read_bytes().replace(b"[0, 4]", b"[0, 8]")
    outside.write_bytes(data)
    with pytest.raises(CorruptFileError, match=r"outside\.safetensors "):
        compress_file(outside, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_compressed_output_is_smaller_than_each_dtype_needs(tmp_path: Path) -> None:
    """Each transform pays on weight-like data, and never costs more than 1 %."""
    for dtype, floor in ((torch.bfloat16, 1.45), (torch.float16, 1.1), (torch.float32, 1.15)):
        path = tmp_path / f"{dtype}.safetensors"
        save_file({"w": weights((512, 1024), dtype)}, path)
        packed, _, _ = round_trip(path)
        assert packed.raw_bytes / packed.stored_bytes >= floor, dtype
    noise = tmp_path / "noise.safetensors"
    random_bytes = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
    save_file({"w": torch.from_numpy(random_bytes)}, noise)
    packed, _, _ = round_trip(noise)
    assert packed.stored_bytes <= packed.raw_bytes * 1.01


# ---------------------------------------------------------------------------- bombs


def test_a_bomb_is_refused_before_its_first_frame(tmp_path: Path) -> None:
    """46 KB that claim 1,000 bytes and hold 1 GiB of zeros: refused at once, nothing written."""
    stored = tmp_path / "bomb.safetensors.zst"
    stored.write_bytes(bomb(claimed_bytes=1000, frames=256))
    out = tmp_path / "out.safetensors"
    with pytest.raises(CorruptFileError) as caught:
        decompress_file(stored, out, threads=2)
    assert str(caught.value) == (
        f"Compressed file {stored} is corrupt: frame 0 would restore 4,194,304 bytes at offset "
        "0 of a file its header says holds 1,000. Fetch or compress it again."
    )
    assert caught.value.path == str(stored)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.safetensors.zst"]


BOMB_UNDER_LIMITS = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024**2, 16 * 1024**2))
from shardprep.codec import decompress_file
from shardprep.errors import CorruptFileError
try:
    decompress_file(Path(sys.argv[1]), Path(sys.argv[2]), threads=2)
except CorruptFileError as exc:
    print(exc)
# VmHWM belongs to this process image; ru_maxrss would carry the parent's across exec.
status = Path("/proc/self/status").read_text()
print(int(next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM:"))) // 1024)
"""


def test_a_bomb_stops_at_the_size_its_header_states(tmp_path: Path) -> None:
    """Two frames as claimed, then 254 more: stopped at the third, under a 16 MiB limit on
    the size of any file written (a write past it fails) and with bounded memory."""
    stored = tmp_path / "bomb.zst"
    stored.write_bytes(bomb(claimed_bytes=2 * FRAME_SIZE, frames=256))
    out = tmp_path / "out.safetensors"
    run = subprocess.run(
        [sys.executable, "-c", BOMB_UNDER_LIMITS, str(stored), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    message, max_rss_mib = run.stdout.splitlines()
    assert (
        "frame 2 would restore 4,194,304 bytes at offset 8,388,608 of a file its header says "
        "holds 8,388,608" in message
    )
    assert int(max_rss_mib) < 400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.zst"]


def test_expected_size_is_checked_before_anything_is_written(
    stored_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.safetensors"
    raw_size = decompress_file(stored_file, out).raw_bytes
    out.unlink()
    with pytest.raises(CorruptFileError, match=f"restores {raw_size:,} bytes where 1,000 are"):
        decompress_file(stored_file, out, expected_bytes=1000)
    plain = tmp_path / "model.safetensors"
    with pytest.raises(CorruptFileError, match="more than the 1,000 bytes expected"):
        decompress_file(plain, out, expected_bytes=1000)
    assert not out.exists()
    assert not list(tmp_path.glob("*.incomplete"))
    assert decompress_file(plain, out, expected_bytes=plain.stat().st_size).raw_bytes > 1000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_decodes_with_threads_of_its_own(stored_file: Path, tmp_path: Path) -> None:
    """The worker pools outlive a call; a child forked after one must not wait on the
    parent's threads, which it does not have (vLLM forks its workers)."""
    decompress_file(stored_file, tmp_path / "parent.safetensors", threads=2)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it decodes the same bytes
        try:
            decompress_file(stored_file, tmp_path / "child.safetensors", threads=2)
            same = (tmp_path / "child.safetensors").read_bytes() == (
                tmp_path / "parent.safetensors"
            ).read_bytes()
            os._exit(0 if same else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung decoding with the parent's thread pool")
