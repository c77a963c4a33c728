"""How far the hashing of a plain folder's source files may fall behind their move
(`scatter.catch_up`): finished hashes are forgotten, the oldest is waited for only while
the files being hashed hold more than the allowed bytes, the newest never."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

import pytest

from shardprep.convert.scatter import catch_up


def running(*sizes: int) -> deque[tuple[Future[str], int]]:
    return deque((Future(), size) for size in sizes)


def catching_up(behind: deque[tuple[Future[str], int]], lag: int) -> threading.Event:
    """Run `catch_up` on a thread (a wrong one may wait forever); set when it returns."""
    returned = threading.Event()
    threading.Thread(target=lambda: (catch_up(behind, lag), returned.set()), daemon=True).start()
    return returned


def test_within_the_lag_nothing_is_waited_for() -> None:
    behind = running(3, 2)
    assert catching_up(behind, 5).wait(5)
    assert [size for _, size in behind] == [3, 2]


def test_the_newest_is_never_waited_for() -> None:
    behind = running(10**12)
    assert catching_up(behind, 0).wait(5)
    assert len(behind) == 1


def test_finished_hashes_are_forgotten_oldest_first() -> None:
    behind = running(3, 2, 7, 1)
    behind[0][0].set_result("a")
    behind[2][0].set_result("c")  # behind an unfinished one: kept, counted, harmless
    assert catching_up(behind, 100).wait(5)
    assert [size for _, size in behind] == [2, 7, 1]


def test_past_the_lag_the_oldest_is_waited_for() -> None:
    behind = running(3, 2, 1)
    oldest, second = behind[0][0], behind[1][0]
    returned = catching_up(behind, 3)
    assert not returned.wait(0.2), "returned while 6 bytes were behind, with 3 allowed"
    oldest.set_result("a")  # 3 bytes left behind: within the lag
    assert returned.wait(5)
    assert [size for _, size in behind] == [2, 1]
    assert not second.done()


def test_a_failed_hash_is_raised() -> None:
    behind = running(3, 2)
    behind[0][0].set_exception(OSError("file ended at byte 7, before byte 9"))
    with pytest.raises(OSError, match="file ended at byte 7"):
        catch_up(behind, 100)
