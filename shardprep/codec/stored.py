"""What the container stores, as numbers: segment kinds, stream methods, F16 layouts, the
dtype table, and a frame as read from a file. A leaf: it imports nothing of shardprep,
so the format's readers (`container`), its coders (`transforms`) and the compiled loops
(`compiled`) all take these from here and none needs another for them.

What each kind means and how its streams are laid out is told in `transforms`; how
frames, segments and streams sit in a file, in `container`.
"""

from __future__ import annotations

from dataclasses import dataclass

PLAIN, PLANES, BF16, F16, F32 = range(5)  # segment kinds, as stored
LZ_BYTES = 5  # planned only: stored as PLANES(1), compressed with zstd level 3
BF16_7 = 6  # stored: BF16 with 7-bit symbols
RAW, ZSTD = 0, 1  # stream methods, as stored
F16_BYTE, F16_SIGNS = 0, 1  # F16 layouts (the segment's param): earlier, and written now

# dtype -> (kind, item size); any other dtype (integers, bool, F64...) is LZ_BYTES.
DTYPE_KINDS = {
    "BF16": (BF16_7, 2),
    "F16": (F16, 2),
    "F32": (F32, 4),
    "F8_E4M3": (PLANES, 1),
    "F8_E5M2": (PLANES, 1),
}


@dataclass(frozen=True)
class Frame:
    """A frame as read from the file: its tables, checked, and its stream bytes."""

    index: int
    start: int  # where its bytes go in the restored file
    raw_len: int
    segments: list[tuple[int, int, int]]  # (kind, param, raw_len)
    streams: list[tuple[int, int, int]]  # (method, raw_len, stored_len)
    payload: memoryview
