"""Hostile containers built byte by byte from the format in shardprep/codec/container.py."""

from __future__ import annotations

import struct

import zstandard

FRAME_SIZE = 4 * 1024**2


def bomb(claimed_bytes: int, frames: int, frame_size: int = FRAME_SIZE) -> bytes:
    """A container whose header claims `claimed_bytes` but whose `frames` frames each
    restore `frame_size` zero bytes (one plain segment, one zstd stream apiece)."""
    zeros = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(bytes(frame_size))
    frame = (
        struct.pack("<4sIII", b"SPFR", frame_size, 1, 1)
        + struct.pack("<BBHI", 0, 0, 0, frame_size)
        + struct.pack("<B3xII", 1, frame_size, len(zeros))
        + zeros
    )
    head = struct.pack("<8sHHIQ", b"\x89SPZ\r\n\x1a\n", 1, 0, frame_size, claimed_bytes)
    trailer = struct.pack("<8sQQ32s", b"SPEND\0\0\0", frames, claimed_bytes, bytes(32))
    return head + frame * frames + trailer
