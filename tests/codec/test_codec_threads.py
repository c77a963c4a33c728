"""The codec's thread helpers: who runs which item, and what an error stops."""

from __future__ import annotations

import threading
import time

import pytest

from shardprep.codec.streams import shared_map


class Recorder:
    """Records which thread ran each item, and how many items are running."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.lock = threading.Lock()
        self.ran: list[tuple[int, str]] = []
        self.running = 0
        self.fail_on = fail_on

    def __call__(self, item: int) -> None:
        with self.lock:
            self.running += 1
        try:
            time.sleep(0.002)  # releases the GIL, as zstd and the compiled joins do
            if item == self.fail_on:
                raise ValueError(f"item {item} is damaged")
            with self.lock:
                self.ran.append((item, threading.current_thread().name))
        finally:
            with self.lock:
                self.running -= 1


def test_every_item_runs_once_on_the_caller_and_a_worker() -> None:
    record = Recorder()
    shared_map(record, list(range(40)), threads=2)
    assert sorted(item for item, _ in record.ran) == list(range(40))
    names = {name for _, name in record.ran}
    assert threading.current_thread().name in names
    assert any(name.startswith("shardprep-codec") for name in names)


@pytest.mark.parametrize("items", [[], [7]])
def test_fewer_items_than_threads(items: list[int]) -> None:
    record = Recorder()
    shared_map(record, items, threads=4)
    assert [item for item, _ in record.ran] == items


def test_one_thread_runs_everything_on_the_caller() -> None:
    record = Recorder()
    shared_map(record, list(range(5)), threads=1)
    assert record.ran == [(i, threading.current_thread().name) for i in range(5)]


def test_an_error_stops_new_items_and_waits_for_running_ones() -> None:
    record = Recorder(fail_on=3)
    with pytest.raises(ValueError, match="item 3 is damaged"):
        shared_map(record, list(range(200)), threads=2)
    assert record.running == 0  # nothing still writes once the error is raised
    assert len(record.ran) < 10
