"""The warm read path faults a destination's pages in with one call, and changes no byte."""

from __future__ import annotations

import resource

import pytest
import torch

from shardprep.loader import cpu_read

MIB = 1024**2


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def prefault(tensor: torch.Tensor) -> None:
    cpu_read._PREFAULT(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    if cpu_read._PREFAULT.madvise is False:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")


def test_a_prefaulted_destination_is_written_without_page_faults() -> None:
    fresh = torch.empty(64 * MIB, dtype=torch.uint8)
    prefault(fresh)
    before = faults()
    fresh.fill_(7)
    assert faults() - before < 64  # 16,384 pages of 4 KiB untouched before

    untouched = torch.empty(64 * MIB, dtype=torch.uint8)
    before = faults()
    untouched.fill_(7)
    assert faults() - before > 1000  # what the same write costs without it


def test_prefaulting_keeps_every_byte_and_its_neighbours() -> None:
    whole = torch.arange(3 * MIB + 123, dtype=torch.int32).view(torch.uint8)
    expected = whole.clone()
    part = whole[4095 : 2 * MIB + 5]  # starts and ends inside pages that others share
    prefault(part)
    assert torch.equal(whole, expected)
