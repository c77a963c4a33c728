"""A family's tensors and layout with the checkpoint's quantization applied.

A family says which of its source weights vLLM builds as layers that take the model's
quantization, and the vLLM layer each belongs to (`Family.quantized_weights`: linear
layers and expert projections); the scheme (plan/quant) says what each weight becomes in
the checkpoint (an fp8 weight and its block scales) and how every part is cut. Nothing
here knows a family, and no family repeats a scheme's rules: the callers (plan checks,
the tiny models) ask this module instead of the family.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardprep.format.records import Topology
from shardprep.plan.archs.base import Config, Family, Layout, Param, Shapes
from shardprep.plan.layout import Cut, Piece, ScaleOf
from shardprep.plan.quant import Scheme, scheme_of
from shardprep.plan.quant.fp8 import (
    FP8,
    SCALE_DTYPE,
    LinearShape,
    block_problems,
    moe_block_problems,
    refined_block,
    scale_name,
)
from shardprep.plan.topology import kv_heads_of_rank

LAYER_INDEX = re.compile(r"\.\d+\.")
LARGEST_TP = 64  # the tps a refusal suggests instead are looked for up to here


def _scheme(config: Config) -> Scheme | None:
    scheme = scheme_of(config)
    return None if scheme is None or scheme.problem else scheme


def quantized(family: Family, config: Config, shapes: Shapes) -> dict[str, str]:
    """{source weight: vLLM layer} of the weights stored quantized; empty when unquantized."""
    scheme = _scheme(config)
    if scheme is None:
        return {}
    return {
        weight: layer
        for weight, layer in family.quantized_weights(config, shapes).items()
        if not scheme.skips(layer, weight.removesuffix(".weight"))
    }


def expected_shapes(family: Family, config: Config, **context: Any) -> dict[str, tuple]:
    return {name: shape for name, (shape, _) in _sources(family, config, **context).items()}


def source_dtypes(family: Family, config: Config) -> dict[str, str]:
    """Tensors whose checkpoint dtype is not the model's: the family's own, and what the
    scheme stores (fp8 weights, float32 scales)."""
    own = family.source_dtypes(config)
    if _scheme(config) is None:
        return own
    return own | {name: dtype for name, (_, dtype) in _sources(family, config).items() if dtype}


def _sources(family: Family, config: Config, **context: Any) -> dict[str, tuple[tuple, str]]:
    shapes: dict[str, tuple[tuple, str]] = {
        name: (shape, "") for name, shape in family.expected_shapes(config, **context).items()
    }
    scheme = _scheme(config)
    if scheme is not None:
        plain = {name: shape for name, (shape, _) in shapes.items()}
        for weight in quantized(family, config, plain):
            if weight in plain:
                shapes |= scheme.stored(weight, plain[weight])
    return shapes


def layout(
    family: Family, config: Config, shapes: Shapes, topology: Topology, **context: Any
) -> Layout:
    """The family's layout, each quantized weight's parameter followed by its scales'."""
    base = family.layout(config, shapes, topology, **context)
    scheme = _scheme(config)
    weights = quantized(family, config, shapes)
    if scheme is None or not weights:
        return base
    moe_ways = 1 if context.get("expert_parallel") else topology.tp * int(context.get("dp", 1))
    params: list[Param] = []
    for param in base.params:
        if not any(piece.source in weights for piece in param.pieces):
            params.append(param)
            continue
        scales = tuple(_scale_piece(p, shapes, scheme, topology.tp, moe_ways) for p in param.pieces)
        params.append(dataclasses.replace(param, dtype=FP8))
        params.append(Param(scale_name(param.name), scales, param.stages, SCALE_DTYPE))
    consumed = {piece.source for param in params for piece in param.pieces}
    skipped = {name: why for name, why in base.skipped.items() if name not in consumed}
    return dataclasses.replace(base, params=tuple(params), skipped=skipped)


def _scale_piece(piece: Piece, shapes: Shapes, scheme: Scheme, tp: int, moe_ways: int) -> Piece:
    shape = tuple(shapes[piece.source])
    grid = None
    if piece.expert is not None:  # FusedMoE may refine the blocks of its stacks
        inter = shape[0] if piece.cut is Cut.ROWS else shape[1]
        hidden = shape[1] if piece.cut is Cut.ROWS else shape[0]
        grid = refined_block(scheme, inter // moe_ways, hidden, moe_ways)
    of = ScaleOf(shape, piece.cut, scheme.block, grid, piece.heads)  # type: ignore[arg-type]
    return Piece(scale_name(piece.source), Cut.BLOCK_SCALE, expert=piece.expert, scale_of=of)


@dataclass(frozen=True)
class Quantized:
    """One quantized layer as vLLM's block checks see it, whatever the tp."""

    name: str  # the layer, its layer index written `*`
    kind: str  # "column", "row", "replicated" or "experts"
    input: int
    outputs: tuple[tuple[int, int], ...]  # (rows, KV heads or 0) of each part

    def at(self, scheme: Scheme, tp: int, moe_ways: int) -> list[str]:
        if self.kind == "experts":
            inter, hidden = self.outputs[0][0], self.input
            problems = moe_block_problems(scheme, inter // moe_ways, hidden, moe_ways)
            return [f"{self.name}: {p}" for p in problems]
        total = sum(rows for rows, _ in self.outputs)
        if self.kind == "row":
            shape = LinearShape.row(self.name, self.input, total, tp)
        elif self.kind == "replicated":
            shape = LinearShape.replicated(self.name, self.input, tuple(r for r, _ in self.outputs))
        else:
            sizes = tuple(_rows_per_rank(rows, heads, tp) for rows, heads in self.outputs)
            shape = LinearShape(self.name, self.input, total, tp, sizes)
        return block_problems([shape], scheme)


def _rows_per_rank(rows: int, heads: int, tp: int) -> int:
    if not heads:
        return rows // tp
    first, end = kv_heads_of_rank(heads, tp, 0)
    return rows // heads * (end - first)


def quantized_layers(family: Family, config: Config, layout: Layout, shapes: Shapes) -> list:
    """The distinct quantized layers of a layout (layers alike but for their index, once)."""
    weights = quantized(family, config, shapes)
    found: dict[str, Quantized] = {}
    for param in layout.params:
        pieces = [p for p in param.pieces if p.source in weights]
        if not pieces or param.dtype != FP8:
            continue
        layer = LAYER_INDEX.sub(".*.", weights[pieces[0].source])
        if layer in found:
            continue
        first = tuple(shapes[pieces[0].source])
        if pieces[0].expert is not None:
            inter = first[0] if pieces[0].cut is Cut.ROWS else first[1]
            hidden = first[1] if pieces[0].cut is Cut.ROWS else first[0]
            found[layer] = Quantized(layer, "experts", hidden, ((inter, 0),))
            continue
        kind = {Cut.COLS: "row", Cut.REPLICATE: "replicated"}.get(pieces[0].cut, "column")
        input_size = first[1]
        outputs = tuple((shapes[p.source][0], p.heads) for p in pieces)
        found[layer] = Quantized(layer, kind, input_size, outputs)
    return list(found.values())


def quantization_problems(
    family: Family, config: Config, layout: Layout, shapes: Shapes, tp: int, **context: Any
) -> list[str]:
    """vLLM's refusals of this quantization at `tp` (block and group divisibility), in
    vLLM's words, with the tps that would work."""
    scheme = _scheme(config)
    if scheme is None:
        return []
    layers = quantized_layers(family, config, layout, shapes)
    dp = int(context.get("dp", 1))
    ep = bool(context.get("expert_parallel"))

    def refusals(t: int) -> list[str]:
        return [p for layer in layers for p in layer.at(scheme, t, 1 if ep else t * dp)]

    found = refusals(tp)
    if not found:
        return []
    works = ", ".join(str(t) for t in _fine_tps(family, config, refusals, context)) or "none"
    more = f" (and {len(found) - 1} more layers)" if len(found) > 1 else ""
    return [
        f"vLLM refuses fp8 blocks {list(scheme.block)} at tp={tp}: {found[0]}{more} "
        f"Choose a tp that works: {works}"
    ]


def _fine_tps(
    family: Family, config: Config, refusals: Any, context: dict[str, Any]
) -> Iterable[int]:
    for t in range(1, LARGEST_TP + 1):
        if not family.check(config, t, **context) and not refusals(t):
            yield t
