"""Output memory for `decompress_buffer`, reused from one call to the next.

Writing into fresh memory costs a page fault and the zeroing of every page on first
touch (a fifth of the decoding time of a 45 MB bf16 file here). So the memory of an
output that its caller has let go is kept, one buffer at most and at most
`KEEP_AT_MOST` bytes, and the next output that fits is decoded into those pages, which
are already there.

Only memory that may be kept is advised for huge pages. Faulting in a huge page makes the
kernel compact memory when no free 2 MiB block is at hand, which on a fragmented machine
cost several times what ordinary pages cost (a 1 GiB output: 1.9-3.5 CPU-seconds in 5 of
13 tries, against 0.4-0.6 for ordinary pages): a kept buffer pays that once, a one-off
output larger than `KEEP_AT_MOST` would pay it on every call.

An output is a numpy array over an anonymous mapping, through a memoryview that numpy
holds as the array's base. Every view, slice or reshape of the array (and a tensor made
from it) keeps the array and so that memoryview alive: only when nothing can read the
output any more is the memoryview collected and the mapping kept for reuse.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

KEEP_AT_MOST = 256 * 1024**2  # bytes kept for reuse once no output uses them

_lock = threading.Lock()
_spare: list[mmap.mmap] = []  # at most one mapping, free to be written


def output_array(size: int) -> np.ndarray:
    """A writable u8 array of `size` bytes, over memory already faulted in when an
    earlier output of at least that size has been let go. Raises MemoryError or
    ValueError when `size` cannot be reserved (no page is touched before writing)."""
    with _lock:
        mapping = _spare.pop() if _spare and len(_spare[0]) >= size else None
    if mapping is None:
        mapping = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE") and size <= KEEP_AT_MOST:
            mapping.madvise(mmap.MADV_HUGEPAGE)  # as numpy's own large arrays: fewer faults
    out = np.frombuffer(memoryview(mapping)[:size], np.uint8)
    # On what numpy holds (its own memoryview), which every view of `out` keeps alive.
    weakref.finalize(out.base, _give_back, mapping)
    return out


def _give_back(mapping: mmap.mmap) -> None:
    if len(mapping) > KEEP_AT_MOST:
        return  # unmapped when the last reference goes
    with _lock:
        if not _spare or len(_spare[0]) < len(mapping):
            _spare[:] = [mapping]
