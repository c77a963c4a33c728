"""When a rank reads with GPUDirect Storage: only on CUDA, with the driver, and with more
than one worker process only when asked for (each would open every visible GPU)."""

from __future__ import annotations

import glob

import pytest

from shardprep.loader.gds import ASK_FOR_IT, GDS_DEVICES, GdsRequest


@pytest.mark.parametrize("asked", [None, True, False])
@pytest.mark.parametrize("processes", [1, 2, 16])
def test_never_off_cuda(asked: bool | None, processes: int) -> None:
    for device in ("cpu", "meta", "xpu:0"):
        choice = GdsRequest(asked, processes).decide(device, driver_loaded=True)
        assert not choice.use
        assert choice.why == f"no GDS: device {device}, GDS needs a CUDA device"


@pytest.mark.parametrize("processes", [1, 2, 8])
def test_never_without_the_driver(processes: int) -> None:
    for asked in (None, True):
        choice = GdsRequest(asked, processes).decide("cuda:0", driver_loaded=False)
        assert not choice.use
        assert f"no {GDS_DEVICES} on this machine" in choice.why
        assert ("asked for, but not possible" in choice.why) == bool(asked)


def test_one_worker_uses_it_by_default() -> None:
    choice = GdsRequest().decide("cuda:0", driver_loaded=True)
    assert choice.use and choice.why == "GDS"


@pytest.mark.parametrize("processes", [2, 3, 8, 16])
def test_several_workers_only_when_asked(processes: int) -> None:
    default = GdsRequest(None, processes).decide("cuda:3", driver_loaded=True)
    assert not default.use
    assert f"{processes} worker processes" in default.why
    assert ASK_FOR_IT in default.why
    assert GdsRequest(True, processes).decide("cuda:3", driver_loaded=True).use


@pytest.mark.parametrize("processes", [1, 4])
def test_off_when_asked_off(processes: int) -> None:
    choice = GdsRequest(False, processes).decide("cuda:0", driver_loaded=True)
    assert not choice.use
    assert choice.why == "no GDS: gds false was asked for"


def test_looks_for_the_driver_on_this_machine() -> None:
    choice = GdsRequest().decide("cuda:0")
    assert choice.use == bool(glob.glob(GDS_DEVICES))
