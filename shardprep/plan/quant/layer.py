"""One quantized layer as vLLM's checks of a scheme see it, whatever the tp, and the
parameters a scheme makes of one quantized parameter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardprep.plan.cuts import Piece

# What a scheme's `params` gives: each parameter vLLM builds of one quantized parameter, as
# (name, pieces, dtype or None for the source's), and the stored tensors vLLM loads nowhere
# (name -> why).
QuantParams = tuple[Sequence[tuple[str, tuple[Piece, ...], str | None]], dict[str, str]]


@dataclass(frozen=True)
class Quantized:
    name: str  # the layer, its layer index written `*`
    kind: str  # "column", "row", "replicated" or "experts"
    input: int  # input columns (K); for experts, the hidden size
    outputs: tuple[tuple[int, int], ...]  # (rows, KV heads or 0) of each part; experts: (I, 0)
