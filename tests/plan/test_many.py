"""`no_cycle_collection`: the cyclic collector is off inside and as it was after."""

from __future__ import annotations

import gc

import pytest

from shardprep.plan.many import no_cycle_collection


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_inside_and_as_it_was_after(enabled: bool) -> None:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with no_cycle_collection():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(KeyError), no_cycle_collection():
            raise KeyError("x")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
