"""Writes handed to the kernel at most WRITE_PIECE bytes per call.

One large `write` lets the kernel take large folios (up to 2 MiB each) for the page cache
it fills. On a virtual machine that reports free memory to its host (virtio-balloon free
page reporting, which hands back free blocks of 2 MiB and more), those folios come from
memory the host has taken back, and the first touch of each page costs a fault in the
host. Measured on such a machine (docs/benchmarks-history.md, "Writes of at most
256 KiB"): a rank file's gathered columns cost 0.38-0.76 CPU-s per 0.60 GB written in
2 MiB calls and 0.14-0.17 in 256 or 512 KiB calls; a decompression of 1.07 GB, 1.5-3.0
CPU-s of kernel time in 2 MiB calls and 0.5 in 256 KiB calls. Calls of 1 MiB were as slow
as 2 MiB.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import numpy as np

    Buffer = bytes | bytearray | memoryview | np.ndarray

WRITE_PIECE = 256 * 1024


def pieces(data: Buffer) -> Iterator[memoryview]:
    """`data` (a contiguous buffer) as consecutive views of at most WRITE_PIECE bytes."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_PIECE):
        yield view[start : start + WRITE_PIECE]


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    """All of `data` at `offset` of `fd`, in pieces."""
    for piece in pieces(data):
        while piece:
            n = os.pwrite(fd, piece, offset)
            piece, offset = piece[n:], offset + n


def write_all(handle: BinaryIO, data: Buffer) -> None:
    """All of `data` to `handle` (a binary file object), in pieces."""
    for piece in pieces(data):
        handle.write(piece)
