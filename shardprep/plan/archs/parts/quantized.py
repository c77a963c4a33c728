"""A family's tensors and layout with the checkpoint's quantization applied.

A family says which of its source weights vLLM builds as layers that take the model's
quantization, and the vLLM layer each belongs to (`Family.quantized_weights`: linear
layers and expert projections); the scheme (plan/quant) says what each weight becomes in
the checkpoint (an fp8 weight and its block scales; int4 values packed in int32 with
group scales and the weight's shape) and how every part is cut. Nothing
here knows a family, and no family repeats a scheme's rules: the callers (plan checks,
the tiny models) ask this module instead of the family.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from shardprep.format.dtypes import FLOAT_DTYPES, INTEGER_DTYPES
from shardprep.format.records import Topology
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
)
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant import Example, Scheme, kv_cache, scheme_of
from shardprep.plan.quant.layer import Quantized

LAYER_INDEX = re.compile(r"\.\d+\.")
LARGEST_TP = 64  # the tps a refusal suggests instead are looked for up to here


def _scheme(family: Family, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> Scheme | None:
    scheme = scheme_of(config, ctx.mxfp4_pad)
    return None if scheme is None or scheme.problem else family.quant_scheme(scheme)


def quantized(family: Family, config: Config, shapes: Shapes) -> dict[str, str]:
    """{source weight: vLLM layer} of the weights stored quantized; empty when unquantized."""
    scheme = _scheme(family, config)
    if scheme is None:
        return {}
    return {
        weight: layer
        for weight, layer in family.quantized_weights(config, shapes).items()
        if not scheme.skips(layer, weight.removesuffix(".weight"))
    }


def expected_shapes(
    family: Family, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
) -> dict[str, tuple]:
    return {name: shape for name, (shape, _) in _sources(family, config, ctx).items()}


def source_dtypes(family: Family, config: Config) -> dict[str, str]:
    """Tensors whose checkpoint dtype is not the model's: the family's own, and what the
    scheme stores (fp8 weights, float32 scales)."""
    own = family.source_dtypes(config)
    if _scheme(family, config) is None:
        return own
    return own | {name: dtype for name, (_, dtype) in _sources(family, config).items() if dtype}


def _sources(
    family: Family, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
) -> dict[str, tuple[tuple, str]]:
    shapes: dict[str, tuple[tuple, str]] = {
        name: (shape, "") for name, shape in _family_shapes(family, config, ctx).items()
    }
    scheme = _scheme(family, config)
    if scheme is not None:
        plain = {name: shape for name, (shape, _) in shapes.items()}
        for weight in quantized(family, config, plain):
            if weight in plain:  # what the scheme stores in its place
                del shapes[weight]
                shapes |= scheme.stored(weight, plain[weight])
    return shapes


_LAST: list[Any] = []  # the last (family, config, ctx, shapes) asked


def _family_shapes(family: Family, config: Config, ctx: PlanContext) -> Mapping[str, tuple]:
    """`family.expected_shapes`, which a plan's checks, layout and refusals each ask of the
    same config (half a million tensors at flagship scale): the last answer is kept while
    the same objects ask again. It holds them, so their ids cannot be reused meanwhile."""
    if not (_LAST and _LAST[0] is family and _LAST[1] is config and _LAST[2] is ctx):
        _LAST[:] = [family, config, ctx, MappingProxyType(family.expected_shapes(config, ctx))]
    return _LAST[3]


def examples(family: Family, config: Config) -> dict[str, Example]:
    """What a tiny model (demo/) holds in each tensor the scheme stores: those of the
    quantized weights, and of the weights the family itself stores in the scheme's format
    (DeepSeek-V3.2's indexer `wk`, which vLLM dequantizes while loading)."""
    scheme = _scheme(family, config)
    if scheme is None:
        return {}
    plain = family.expected_shapes(config)
    own = family.source_dtypes(config)
    weights = [w for w in quantized(family, config, plain) if w in plain]
    for name, dtype in own.items():
        if name in plain and dtype not in (*FLOAT_DTYPES, *INTEGER_DTYPES):
            stored = scheme.stored(name, plain[name])
            if all(own.get(n) == d for n, (_, d) in stored.items()):
                weights.append(name)
    return {n: e for w in weights for n, e in scheme.examples(w, plain[w]).items()}


def _logical(
    family: Family, config: Config, shapes: Shapes, ctx: PlanContext = DEFAULT_CONTEXT
) -> dict:
    """The checkpoint's shapes and those of the unquantized weights config.json implies
    (a scheme that stores a weight under other names leaves it out of the checkpoint, one
    that packs it in place stores it under its name in another shape)."""
    expected = _family_shapes(family, config, ctx)
    packed = {n: expected[n] for n, s in shapes.items() if n in expected and expected[n] != s}
    return {**expected, **shapes, **packed}


def layout(
    family: Family,
    config: Config,
    shapes: Shapes,
    topology: Topology,
    ctx: PlanContext = DEFAULT_CONTEXT,
) -> Layout:
    """The family's layout, each quantized weight's parameter followed by its scales'.
    The family lays out the weights a scheme stores under other names (`x.weight_packed`)
    as if the checkpoint held them, whose parameters the scheme then replaces."""
    scheme = _scheme(family, config, ctx)
    if scheme is None:
        return family.layout(config, shapes, topology, ctx)
    sizes = _logical(family, config, shapes, ctx)
    weights = quantized(family, config, sizes)
    implied = {w: sizes[w] for w in weights if w not in shapes and w in sizes}
    base = family.layout(config, {**shapes, **implied}, topology, ctx)
    if not weights:
        return base
    moe_ways = 1 if ctx.expert_parallel else topology.tp * ctx.dp
    params: list[Param] = [
        Param(name, (piece,), stages, kv_cache.SCALE_DTYPE)
        for name, piece, stages in kv_cache.kv_cache_params(
            (name for name in shapes if scheme.kv_cache_scales and family.kv_cache_scales),
            ((param.name, param.stages) for param in base.params),
        )
    ]
    unplaced: dict[str, str] = {}
    for param in base.params:
        if not any(piece.source in weights for piece in param.pieces):
            beside = scheme.alongside(param.pieces, sizes)
            if beside is None:
                params.append(param)
            else:
                params.append(dataclasses.replace(param, pieces=beside[0], dtype=beside[1]))
            continue
        parts, left = scheme.params(param.name, param.pieces, sizes, topology.tp, moe_ways)
        params += [Param(name, pieces, param.stages, dtype) for name, pieces, dtype in parts]
        unplaced |= left
    consumed = {piece.source for param in params for piece in param.pieces}
    skipped = {n: why for n, why in base.skipped.items() if n not in consumed and n not in implied}
    skipped |= {name: why for name, why in unplaced.items() if name in shapes}
    return dataclasses.replace(base, params=tuple(params), skipped=skipped)


def quantized_layers(
    family: Family,
    config: Config,
    layout: Layout,
    shapes: Shapes,
    ctx: PlanContext = DEFAULT_CONTEXT,
) -> list:
    """The distinct quantized layers of a layout (layers alike but for their index, once)."""
    scheme = _scheme(family, config, ctx)
    if scheme is None:
        return []
    sizes = _logical(family, config, shapes, ctx)
    weights = quantized(family, config, sizes)
    found: dict[str, Quantized] = {}
    for param in layout.params:
        # A layer's stacks hold a piece per expert: the first tells the layer, and a layer
        # already found is not looked at further.
        stored = next((p for p in param.pieces if scheme.logical(p.source) in weights), None)
        if stored is None:
            continue
        layer = LAYER_INDEX.sub(".*.", weights[scheme.logical(stored.source)])
        if layer in found:
            continue
        pieces = [
            _weight_piece(p, scheme.logical(p.source))
            for p in param.pieces
            if scheme.logical(p.source) in weights
        ]
        first = tuple(sizes[pieces[0].source])
        if len(first) == 3:  # fused experts, the Hub's [E, H, 2I] and [E, I, H]
            up = pieces[0].cut in (Cut.EXPERT_COLS_T, Cut.MX_W13)
            hidden, inter = (first[1], first[2] // 2) if up else (first[2], first[1])
            found[layer] = Quantized(layer, "experts", hidden, ((inter, 0),))
            continue
        if pieces[0].expert is not None:
            inter = first[0] if pieces[0].cut is Cut.ROWS else first[1]
            hidden = first[1] if pieces[0].cut is Cut.ROWS else first[0]
            found[layer] = Quantized(layer, "experts", hidden, ((inter, 0),))
            continue
        kind = {Cut.COLS: "row", Cut.REPLICATE: "replicated"}.get(pieces[0].cut, "column")
        input_size = first[1]
        outputs = tuple((sizes[p.source][0], p.heads) for p in pieces)
        found[layer] = Quantized(layer, kind, input_size, outputs)
    return list(found.values())


def _weight_piece(piece: Piece, weight: str) -> Piece:
    """The piece of the unquantized weight `weight` that a stored piece holds."""
    if piece.cut is Cut.PACKED and piece.scale_of is not None:
        of = piece.scale_of
        return Piece(weight, of.cut, of.heads, piece.expert)
    return piece._replace(source=weight)


def quantization_problems(
    family: Family,
    config: Config,
    layout: Layout,
    shapes: Shapes,
    tp: int,
    ctx: PlanContext = DEFAULT_CONTEXT,
) -> list[str]:
    """vLLM's refusals of this quantization at `tp` (block and group divisibility), in
    vLLM's words, with the tps that would work."""
    scheme = _scheme(family, config, ctx)
    if scheme is None:
        return []
    layers = quantized_layers(family, config, layout, shapes, ctx)
    experts_only = scheme.name in family.experts_only_schemes
    unplaced = [
        layer
        for layer in layers
        if not scheme.places(layer.kind) or (experts_only and layer.kind != "experts")
    ]
    if unplaced:
        more = f" (and {len(unplaced) - 1} more)" if len(unplaced) > 1 else ""
        if unplaced[0].kind == "experts":
            return [
                f"{scheme.method} {scheme.describe} of routed experts is not supported yet "
                f"({unplaced[0].name}{more}): {scheme.experts_unplaced}"
            ]
        return [
            f"{scheme.method} {scheme.describe} of linear layers is not supported yet: the "
            f"ignore list of quantization_config leaves {unplaced[0].name}{more} quantized; "
            "shardprep converts such checkpoints when only their routed experts are quantized"
        ]
    dp = ctx.dp
    ep = ctx.expert_parallel

    def refusals(t: int) -> list[str]:
        return [p for layer in layers for p in scheme.refusals(layer, t, 1 if ep else t * dp)]

    found = refusals(tp)
    if not found:
        return []
    works = ", ".join(str(t) for t in _fine_tps(family, config, refusals, ctx)) or "none"
    more = f" (and {len(found) - 1} more layers)" if len(found) > 1 else ""
    return [
        f"vLLM refuses {scheme.describe} at tp={tp}: {found[0]}{more} "
        f"Choose a tp that works: {works}"
    ]


def _fine_tps(family: Family, config: Config, refusals: Any, ctx: PlanContext) -> Iterable[int]:
    for t in range(1, LARGEST_TP + 1):
        if not family.check(config, t, ctx) and not refusals(t):
            yield t
