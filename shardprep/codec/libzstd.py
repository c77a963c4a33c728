"""The system's libzstd, found through ctypes, for `compiled.decode_frame` to call by address.

`zstandard` allocates a new bytes object for every stream it decodes and its bundled
libzstd decodes our Huffman-only streams more slowly than the system's does: the symbol
streams of MiniLM in bf16 took 11.6-12.0 ms through `zstandard.decompress` and 10.2 ms
through the system's `ZSTD_decompressDCtx` into a buffer that is reused. Where no libzstd
1.4 or later is found, decoding goes through `zstandard` as before (same bytes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

MIN_VERSION = 10400  # 1.4.0, as ZSTD_versionNumber() reports it
_NAMES = ("libzstd.so.1", "libzstd.1.dylib")

_lock = threading.Lock()
_found: Library | Literal[False] | None = False  # False: not looked for yet
_local = threading.local()


@dataclass(frozen=True)
class Library:
    """The library's handle and the address of ZSTD_decompressDCtx(dctx, dst, capacity,
    src, size), which returns the size written or an error code (a value no frame's size
    can take)."""

    handle: ctypes.CDLL
    decompress: int
    version: int


def library() -> Library | None:
    """The system's libzstd, looked for once; None where there is none new enough."""
    global _found
    with _lock:
        if _found is False:
            _found = _load()
        return _found or None


def thread_context(lib: Library) -> int:
    """This thread's decompression context (ZSTD_DCtx *), freed with the thread."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        pointer = lib.handle.ZSTD_createDCtx()
        if not pointer:
            raise MemoryError("libzstd could not allocate a decompression context")
        dctx = _local.dctx = _Context(pointer)
        weakref.finalize(dctx, lib.handle.ZSTD_freeDCtx, pointer)
    return dctx.pointer


class _Context:
    def __init__(self, pointer: int) -> None:
        self.pointer = pointer


def _candidates() -> Iterator[str]:
    yield from _NAMES
    found = ctypes.util.find_library("zstd")  # runs ldconfig: only if the names fail
    if found:
        yield found


def _load() -> Library | None:
    for name in _candidates():
        try:
            handle = ctypes.CDLL(name)
            handle.ZSTD_versionNumber.restype = ctypes.c_uint
            handle.ZSTD_createDCtx.restype = ctypes.c_void_p
            handle.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
            version = handle.ZSTD_versionNumber()
            address = ctypes.cast(handle.ZSTD_decompressDCtx, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if version >= MIN_VERSION and address:
            return Library(handle, address, version)
    return None
