"""Runs in the deriving child, beside probe.py: the values a layer writes into its own
parameters while vLLM builds the model (`weight.data[-padding:].zero_()`: rows a fused
layer pads each rank's output with and never loads). What `load_weights` then leaves of
them is part of vLLM's state after loading, so a rank's record carries it as `built`
ops after the load's own, each a contiguous run of a parameter no load write covers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardprep.plan.derived.regions import is_contiguous, span

FILLS = {"fill_", "zero_"}


class BuiltFills(TorchDispatchMode):
    """Every fill while a model is built, by the storage it writes (held, so that no
    later tensor reuses its address), its region and value; nothing else is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.fills: list[tuple[int, list[Any], float]] = []
        self.held: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name in FILLS and args and isinstance(args[0], torch.Tensor):
            dst = args[0]
            storage = dst.untyped_storage()
            self.held.append(storage)
            value = 0.0 if name == "zero_" else float(args[1])
            region = [dst.storage_offset(), list(dst.shape), list(dst.stride())]
            self.fills.append((storage._cdata, region, value))
        return out

    def of_params(self, params: dict[str, torch.Tensor]) -> list[list[Any]]:
        """The fills into the parameters (as built, before any is replaced on meta), as
        `["built", parameter, region, value]` ops in the order they ran."""
        names = {param.untyped_storage()._cdata: name for name, param in params.items()}
        found = [["built", names.get(key), region, value] for key, region, value in self.fills]
        self.held.clear()
        return [op for op in found if op[1] is not None]


def left_by_load(built: list[list[Any]], ops: list[list[Any]]) -> list[list[Any]]:
    """The parts of the built fills of parameters the load writes into that no load
    write covers, one op per contiguous run; a parameter the load leaves whole as built
    is not one (the inference keeps it out of the plan). A built fill that is not one
    contiguous run is kept whole unless the load covers it, for the inference to refuse."""
    written: dict[str, list[tuple[int, int]]] = {}
    for op in ops:
        written.setdefault(op[1], []).append(span(op[2]))
    left = []
    for kind, param, region, value in built:
        if param not in written:
            continue
        start, end = span(region)
        runs = _uncovered(start, end, written[param])
        if not is_contiguous(region):
            left += [[kind, param, region, value]] if runs else []
            continue
        left += [[kind, param, [s, [e - s], [1]], value] for s, e in runs]
    return left


def _uncovered(start: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The runs of [start, end) outside every span."""
    runs, position = [], start
    for s, e in sorted(spans):
        if e <= position or s >= end:
            continue
        if s > position:
            runs.append((position, s))
        position = max(position, e)
    if position < end:
        runs.append((position, end))
    return runs
