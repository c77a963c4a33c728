"""Output memory for `decompress_buffer`, reused from one call to the next.

Writing into fresh memory costs a page fault and the zeroing of every page on first
touch (a fifth of the decoding time of a 45 MB bf16 file here). So the memory of an
output that its caller has let go is kept, one buffer at most and at most
`KEEP_AT_MOST` bytes, and the next output that fits is decoded into those pages, which
are already there.

Memory is advised for huge pages (fewer faults) when it may be kept, and a larger one-off
output only while the kernel has free huge-page blocks for twice its size. Faulting in a
huge page with none free makes the kernel compact memory, which on a fragmented machine
cost several times what ordinary pages cost (a 1 GiB output: 1.9-3.5 CPU-seconds in 5 of
13 tries, against 0.4-0.6 for ordinary pages); a kept buffer pays that once, a one-off
output on every call.

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
HUGE_PAGE = 2 * 1024**2
BUDDYINFO = "/proc/buddyinfo"

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
        if hasattr(mmap, "MADV_HUGEPAGE") and advise_huge_pages(size):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    out = np.frombuffer(memoryview(mapping)[:size], np.uint8)
    # On what numpy holds (its own memoryview), which every view of `out` keeps alive.
    weakref.finalize(out.base, _give_back, mapping)
    return out


def advise_huge_pages(size: int) -> bool:
    """Memory that may be kept, or while free huge-page blocks hold twice `size`."""
    return size <= KEEP_AT_MOST or 2 * size <= free_huge_page_bytes()


def free_huge_page_bytes() -> int:
    """Bytes in the kernel's free blocks of at least a huge page; 0 where unknown."""
    try:
        with open(BUDDYINFO) as handle:
            return huge_blocks_in_buddyinfo(handle.read(), mmap.PAGESIZE)
    except (OSError, ValueError):
        return 0


def huge_blocks_in_buddyinfo(text: str, page_size: int) -> int:
    """Bytes in free blocks of `HUGE_PAGE` or more, from /proc/buddyinfo's text: per zone,
    the count of free blocks of 2**order pages for each order from 0."""
    total = 0
    for line in text.splitlines():
        _, _, counts = line.partition("zone")
        for order, count in enumerate(counts.split()[1:]):
            if page_size << order >= HUGE_PAGE:
                total += int(count) * (page_size << order)
    return total


def _give_back(mapping: mmap.mmap) -> None:
    if len(mapping) > KEEP_AT_MOST:
        return  # unmapped when the last reference goes
    with _lock:
        if not _spare or len(_spare[0]) < len(mapping):
            _spare[:] = [mapping]
