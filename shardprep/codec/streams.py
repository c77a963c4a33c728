"""Moving bytes for the codec: hashing readers and writers, atomic output, worker threads.

Worker pools are started once per process (one per thread count) and reused, so a
small file pays no thread start-up; zstd, hashlib and numpy release the GIL, so frames
really run in parallel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

import numpy as np

from shardprep.constants import INCOMPLETE_SUFFIX
from shardprep.errors import CorruptFileError
from shardprep.pieces import write_all

MAX_PENDING_UPDATES = 4  # updates a BackgroundSha256 may still hold once update() returns
_T = TypeVar("_T")
_R = TypeVar("_R")


class Hash(Protocol):
    def update(self, data: bytes | memoryview | np.ndarray, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


class NoHash:
    """For benchmarks of the codec alone: hashes nothing, digests to 32 zero bytes."""

    def update(self, data: object, /) -> None:
        pass

    def digest(self) -> bytes:
        return bytes(32)

    def hexdigest(self) -> str:
        return "0" * 64


class HashingReader:
    """Reads a binary stream, hashing (sha256 unless told) and counting what it hands out."""

    def __init__(self, handle: BinaryIO, name: str, sha: Hash | None = None) -> None:
        self._handle = handle
        self.name = name
        self.count = 0
        self._sha = hashlib.sha256() if sha is None else sha

    def read(self, size: int) -> bytes:
        data = self._handle.read(size)
        self._sha.update(data)
        self.count += len(data)
        return data

    def read_exact(self, size: int, what: str) -> bytes:
        data = self.read(size)
        if len(data) != size:
            raise CorruptFileError(f"truncated: {what} ends after {len(data)} of {size} bytes")
        return data

    def digest(self) -> bytes:
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class HashingWriter:
    """Writes to a binary stream, hashing (sha256 unless told) and counting every byte."""

    def __init__(self, handle: BinaryIO, sha: Hash | None = None) -> None:
        self._handle = handle
        self.count = 0
        self._sha = hashlib.sha256() if sha is None else sha

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        self._sha.update(data)
        write_all(self._handle, data)
        self.count += memoryview(data).nbytes

    def digest(self) -> bytes:
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class BackgroundSha256:
    """sha256 fed in order on a thread of its own, overlapping reading, coding and writing.

    At most a few updates (and the buffers they hold) wait at any time.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._sha = hashlib.sha256()
        self._pool = pool
        self._pending: deque[Future[None]] = deque()

    def update(self, data: bytes | memoryview | np.ndarray, /) -> None:
        self._pending.append(self._pool.submit(self._sha.update, data))
        while len(self._pending) > MAX_PENDING_UPDATES:
            self._pending.popleft().result()

    def digest(self) -> bytes:
        while self._pending:
            self._pending.popleft().result()
        return self._sha.digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


@contextmanager
def sha256_pair(threads: int) -> Iterator[tuple[Hash, Hash]]:
    """Two sha256 (raw and stored bytes): on two threads of their own unless threads == 1."""
    if threads == 1:
        yield hashlib.sha256(), hashlib.sha256()
        return
    first, second = _pool("shardprep-sha-a", 1), _pool("shardprep-sha-b", 1)
    yield BackgroundSha256(first), BackgroundSha256(second)


@contextmanager
def atomic_output(dst: Path, like: Path) -> Iterator[BinaryIO]:
    """Yield a temporary file next to `dst`; rename it to `dst` only if the block succeeds."""
    fd, tmp_name = tempfile.mkstemp(
        prefix=f".{dst.name}.", suffix=INCOMPLETE_SUFFIX, dir=dst.parent
    )
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        shutil.copymode(like, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- threads

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked child (vLLM forks its workers) has none of the parent's threads: it must
    start pools of its own, or its first task would wait forever."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def _pool(name: str, threads: int) -> ThreadPoolExecutor:
    """A pool started on first use and kept for the life of the process."""
    with _pools_lock:
        pool = _pools.get((name, threads))
        if pool is None:
            pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
            _pools[(name, threads)] = pool
        return pool


def ordered_map(fn: Callable[[_T], _R], items: Iterable[_T], threads: int) -> Iterator[_R]:
    """map(fn, items) over `threads` workers, in order, with at most threads + 1 in flight.

    `items` is consumed lazily in the calling thread, so reading stays sequential. Must
    not be called from one of its own workers.
    """
    if threads == 1:
        yield from map(fn, items)
        return
    pool = _pool("shardprep-codec", threads)
    pending: deque[Future[_R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        for future in pending:  # a worker still writing into a caller's buffer: wait for it
            if not future.cancelled():
                future.exception()


def shared_map(fn: Callable[[_T], None], items: Iterable[_T], threads: int) -> None:
    """Call fn on every item: the calling thread and `threads - 1` workers each take the
    next item (`items` is iterated under a lock) when done with one, so no thread waits
    for another to hand out work.

    After an error (from fn or from `items`) no new item is taken; the first error is
    raised once every thread has stopped, since a worker may be writing into the caller's
    buffer until then. Must not be called from one of its own workers.
    """
    lock = threading.Lock()
    source = iter(items)
    failed = False

    def work() -> None:
        nonlocal failed
        while True:
            try:
                with lock:
                    if failed:
                        return
                    try:
                        item = next(source)
                    except StopIteration:
                        return
                fn(item)
            except BaseException:
                failed = True
                raise

    pool = _pool("shardprep-codec", threads) if threads > 1 else None
    futures = [pool.submit(work) for _ in range(threads - 1)] if pool else []
    try:
        work()
    finally:
        errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error
