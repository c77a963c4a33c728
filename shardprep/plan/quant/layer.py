"""One quantized layer as vLLM's checks of a scheme see it, whatever the tp."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quantized:
    name: str  # the layer, its layer index written `*`
    kind: str  # "column", "row", "replicated" or "experts"
    input: int  # input columns (K); for experts, the hidden size
    outputs: tuple[tuple[int, int], ...]  # (rows, KV heads or 0) of each part; experts: (I, 0)
