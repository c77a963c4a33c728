"""sha256 of files, fed through a small buffer that each thread reuses.

sha256 runs at the speed of the CPU's SHA instructions only on bytes already in its
cache. Hashed straight from the page cache through a mapping, the bytes come from main
memory a 4 KiB page at a time, and sha256 took 0.90-0.98 CPU-s per GB on one machine we
measured, where copying them into a 1 MiB buffer first (kept in the core's L2 cache) and
hashing that took 0.73-0.76, copy included (docs/benchmarks-history.md, "Hashing
through a small buffer").
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

HASH_BUFFER = 1024**2
# Where the next bytes to hash may still be on disk, ask the kernel for this much ahead.
READ_AHEAD = 32 * 1024**2

_local = threading.local()


def _buffer() -> memoryview:
    view = getattr(_local, "buffer", None)
    if view is None:
        view = _local.buffer = memoryview(bytearray(HASH_BUFFER))
    return view


def update_from_file(digest: Any, fd: int, start: int, end: int, *, ahead: bool = False) -> None:
    """Feed bytes [start, end) of the open file `fd` to `digest`, in order. With `ahead`,
    the kernel is asked to read ahead of the hashing (for files not yet in the page cache)."""
    buffer, offset, advised = _buffer(), start, start
    while offset < end:
        if ahead and offset >= advised and hasattr(os, "POSIX_FADV_WILLNEED"):
            os.posix_fadvise(fd, offset, READ_AHEAD, os.POSIX_FADV_WILLNEED)
            advised = offset + READ_AHEAD // 2
        n = os.preadv(fd, [buffer[: min(HASH_BUFFER, end - offset)]], offset)
        if n == 0:
            raise OSError(f"file ended at byte {offset:,}, before byte {end:,}")
        digest.update(buffer[:n])
        offset += n


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at `path` (read ahead of the hashing)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "POSIX_FADV_SEQUENTIAL"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        update_from_file(digest, fd, 0, os.fstat(fd).st_size, ahead=True)
    finally:
        os.close(fd)
    return digest.hexdigest()
