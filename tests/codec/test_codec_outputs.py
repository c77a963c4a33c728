"""decompress_buffer's outputs: memory reused once let go, never while anything reads it."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from shardprep.codec import compress_file, decompress_buffer, outputs


def stored_bytes(tmp_path: Path, seed: int, rows: int = 256) -> tuple[bytes, bytes]:
    """(raw safetensors bytes, their zstd container) of random bf16 weights."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, 512, generator=generator) * 0.02).to(torch.bfloat16)
    raw_path, stored = tmp_path / f"w{seed}.safetensors", tmp_path / f"w{seed}.spz"
    save_file({"w": weight}, raw_path)
    compress_file(raw_path, stored, frame_size=64 * 1024)
    return raw_path.read_bytes(), stored.read_bytes()


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def hold(array: np.ndarray, keep: str) -> object:
    """Something made from `array` that still reads its memory."""
    if keep == "slice":
        return array[8:].reshape(-1, 8)
    if keep == "tensor":
        return torch.from_numpy(array)
    if keep == "memoryview":
        return memoryview(array)
    return array


@pytest.fixture(autouse=True)
def no_spare() -> None:
    gc.collect()
    outputs._spare.clear()


def test_a_released_output_is_decoded_into_again(tmp_path: Path) -> None:
    raw_a, stored_a = stored_bytes(tmp_path, 0)
    raw_b, stored_b = stored_bytes(tmp_path, 1)
    first = decompress_buffer(stored_a, threads=2)
    where = address(first)
    assert first.tobytes() == raw_a
    del first
    gc.collect()
    second = decompress_buffer(stored_b, threads=2)
    assert address(second) == where
    assert second.tobytes() == raw_b


@pytest.mark.parametrize("keep", ["slice", "tensor", "memoryview", "array"])
def test_an_output_still_read_is_never_reused(tmp_path: Path, keep: str) -> None:
    raw_a, stored_a = stored_bytes(tmp_path, 0)
    raw_b, stored_b = stored_bytes(tmp_path, 1)
    first = decompress_buffer(stored_a, threads=2)
    held = hold(first, keep)
    where = address(first)
    del first
    gc.collect()
    second = decompress_buffer(stored_b, threads=2)
    assert address(second) != where
    assert second.tobytes() == raw_b
    restored = bytes(held.numpy() if isinstance(held, torch.Tensor) else held)  # type: ignore[arg-type]
    assert restored == (raw_a[8:] if keep == "slice" else raw_a)


def test_a_larger_output_gets_fresh_memory_and_is_kept_instead(tmp_path: Path) -> None:
    raw_small, stored_small = stored_bytes(tmp_path, 0, rows=64)
    raw_large, stored_large = stored_bytes(tmp_path, 1, rows=512)
    small = decompress_buffer(stored_small)
    small_at = address(small)
    del small
    gc.collect()
    large = decompress_buffer(stored_large)
    assert address(large) != small_at and large.tobytes() == raw_large
    large_at = address(large)
    del large
    gc.collect()
    again = decompress_buffer(stored_small)  # fits in the larger memory kept
    assert address(again) == large_at and again.tobytes() == raw_small


def test_memory_above_the_limit_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outputs, "KEEP_AT_MOST", 4096)
    big = outputs.output_array(8192)
    big[:] = 1
    del big
    gc.collect()
    assert outputs._spare == []
    kept = outputs.output_array(4096)
    del kept
    gc.collect()
    assert len(outputs._spare) == 1


def _vm_flags(array: np.ndarray) -> set[str]:
    """The kernel's VmFlags of the mapping that holds `array`'s first byte."""
    start = address(array)
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= start < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError("no mapping holds the array")


BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32     64     47     39     40     41     38     43     41     26     23    725
Node 0, zone   Normal  23829  43774  28936  23003   8013   1432   2123   2364   1124    298   1241
"""


def test_free_huge_page_blocks_are_read_from_buddyinfo() -> None:
    """Orders 9 (2 MiB) and 10 (4 MiB) of 4 KiB pages; the smaller blocks do not count."""
    mib = 1024**2
    want = (1 + 23 + 298) * 2 * mib + (3 + 725 + 1241) * 4 * mib
    assert outputs.huge_blocks_in_buddyinfo(BUDDYINFO, 4096) == want
    assert outputs.huge_blocks_in_buddyinfo(BUDDYINFO, 64 * 1024) > want  # 64 KiB pages
    assert outputs.huge_blocks_in_buddyinfo("", 4096) == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's smaps")
@pytest.mark.parametrize("free_mib", [0, 15, 16])
def test_a_one_off_output_gets_huge_pages_only_while_free_blocks_hold_twice_its_size(
    monkeypatch: pytest.MonkeyPatch, free_mib: int
) -> None:
    """Faulting in huge pages with no free block compacts memory, which costs more than
    it saves for memory used once; memory that may be kept is always advised."""
    monkeypatch.setattr(outputs, "KEEP_AT_MOST", 4 * 1024**2)
    monkeypatch.setattr(outputs, "free_huge_page_bytes", lambda: free_mib * 1024**2)
    small, big = outputs.output_array(4 * 1024**2), outputs.output_array(8 * 1024**2)
    assert "hg" in _vm_flags(small)
    assert ("hg" in _vm_flags(big)) is (free_mib >= 16)


def test_free_huge_page_bytes_reads_this_machine() -> None:
    free = outputs.free_huge_page_bytes()
    assert free >= 0 and free % outputs.HUGE_PAGE == 0
