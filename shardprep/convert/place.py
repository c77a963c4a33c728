"""Placing a chunk of a source tensor in the rank files: each write (`rankfiles.Write`)
takes its rows of the chunk, cut, upsampled, transposed or padded as its block says, in
its dtype, through the `Mover` that writes the rank files; reading is the caller's."""

from __future__ import annotations

import numpy as np

from shardprep.convert.rankfiles import Mover, Write
from shardprep.format.dtypes import DTYPE_SIZES, cast, torch_dtype
from shardprep.format.headers import TensorInfo


def scatter_chunk(
    mover: Mover, info: TensorInfo, start: int, chunk: memoryview, targets: list[Write]
) -> None:
    """Write the rows of `info` that `chunk` holds (from row `start` on) to every target
    that takes any of them: sliced by columns, upsampled, transposed or padded, and cast
    where the target asks for it."""
    if not targets or not len(chunk):
        return
    row_bytes = info.row_bytes
    rows = len(chunk) // row_bytes
    end = start + rows
    for target in targets:
        if target.repeat != (1, 1):
            _scatter_upsampled(mover, info, start, chunk, target)
            continue
        if target.matrix is not None:
            _scatter_transposed(mover, info, start, chunk, target)
            continue
        if target.slab is not None:
            _scatter_slab(mover, info, start, chunk, target)
            continue
        first, last = max(start, target.rows[0]), min(end, target.rows[1])
        if first >= last:
            continue
        if target.cols is None and target.dtype == info.dtype:
            data: memoryview | np.ndarray = chunk[
                (first - start) * row_bytes : (last - start) * row_bytes
            ]
        else:
            block = np.frombuffer(chunk, np.uint8).reshape(rows, row_bytes)[
                first - start : last - start
            ]
            if target.cols is not None:
                size = DTYPE_SIZES[info.dtype]
                block = block[:, target.cols[0] * size : target.cols[1] * size]
            data = mover.gathered(block)
            if target.dtype != info.dtype:
                data = _cast(data, info.dtype, target.dtype)
        dest_row = target.dest_row + first - target.rows[0]
        mover.write(target.file, data, target.row_offset + dest_row * target.row_bytes)


def _scatter_upsampled(
    mover: Mover, info: TensorInfo, start: int, chunk: memoryview, target: Write
) -> None:
    """A block cut from the source upsampled first (fp8 block scales on a finer grid):
    `target.rows` and `target.cols` are in upsampled coordinates."""
    up, across = target.repeat
    rows = len(chunk) // info.row_bytes
    first = max(start, target.rows[0] // up)
    last = min(start + rows, -(-target.rows[1] // up))
    if first >= last:
        return
    size = DTYPE_SIZES[info.dtype]
    block = np.frombuffer(chunk, np.uint8).reshape(rows, -1, size)[first - start : last - start]
    block = np.repeat(np.repeat(block, up, axis=0), across, axis=1)
    low, high = max(first * up, target.rows[0]), min(last * up, target.rows[1])
    block = block[low - first * up : high - first * up]
    if target.cols is not None:
        block = block[:, target.cols[0] : target.cols[1]]
    data = np.ascontiguousarray(block).reshape(high - low, -1)
    if target.dtype != info.dtype:
        data = _cast(data, info.dtype, target.dtype)
    dest_row = target.dest_row + low - target.rows[0]
    mover.write(target.file, data, target.row_offset + dest_row * target.row_bytes)


def _scatter_transposed(
    mover: Mover, info: TensorInfo, start: int, chunk: memoryview, target: Write
) -> None:
    """Each dim-0 row of a 3-D source is an [A, B] matrix (an expert's): the part
    `target.matrix` names goes transposed, one destination row per matrix column."""
    assert target.matrix is not None
    rows = len(chunk) // info.row_bytes
    first, last = max(start, target.rows[0]), min(start + rows, target.rows[1])
    if first >= last:
        return
    (a0, a1), (b0, b1) = target.matrix
    size = DTYPE_SIZES[info.dtype]
    values = np.frombuffer(chunk, f"<u{size}").reshape(rows, info.shape[1], info.shape[2])
    part = values[first - start : last - start, a0:a1, b0:b1].transpose(0, 2, 1)
    data = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
    if target.dtype != info.dtype:
        data = _cast(data, info.dtype, target.dtype)
    dest_row = target.dest_row + (first - target.rows[0]) * (b1 - b0)
    mover.write(target.file, data, target.row_offset + dest_row * target.row_bytes)


def _scatter_slab(
    mover: Mover, info: TensorInfo, start: int, chunk: memoryview, target: Write
) -> None:
    """Each dim-0 row of the source, viewed as [dim 1, the rest], gives the part
    `target.slab` names in the top-left corner of a zero matrix (a padded MXFP4 expert)."""
    assert target.slab is not None
    rows = len(chunk) // info.row_bytes
    first, last = max(start, target.rows[0]), min(start + rows, target.rows[1])
    if first >= last:
        return
    (a0, a1), (b0, b1), (height, width) = target.slab
    size = DTYPE_SIZES[info.dtype]
    inner = info.shape[1] if len(info.shape) > 2 else 1
    values = np.frombuffer(chunk, f"<u{size}").reshape(rows, inner, -1)
    out = np.zeros((last - first, height, width), f"<u{size}")
    out[:, : a1 - a0, : b1 - b0] = values[first - start : last - start, a0:a1, b0:b1]
    data = out.reshape(-1).view(np.uint8)
    if target.dtype != info.dtype:
        data = _cast(data, info.dtype, target.dtype)
    dest_row = target.dest_row + (first - target.rows[0]) * height
    mover.write(target.file, data, target.row_offset + dest_row * target.row_bytes)


def _cast(data: np.ndarray, source: str, dest: str) -> np.ndarray:
    """Raw bytes of `source` dtype -> raw bytes of `dest` (torch only for this)."""
    import torch

    data = data.reshape(-1) if data.flags.writeable else data.reshape(-1).copy()
    values = torch.from_numpy(data).view(torch_dtype(torch, source))
    return cast(torch, values, torch_dtype(torch, dest)).view(torch.uint8).numpy()
