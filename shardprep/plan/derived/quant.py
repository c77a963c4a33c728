"""A derived layout of a quantized checkpoint in its scheme's own terms (plan/quant).

The derivation finds, for a quantized weight's parameter and for its scales, cuts of
rows or columns that give the regions vLLM copied. The scheme says the same thing in its
own words (an fp8 block scale is cut with its weight, in whole blocks; an fp4 weight's
bytes, two values each, are the columns of the weight they store cut in whole bytes), which
is what plans, checks and the manifest's records read. Each parameter the scheme would make of a
derived weight replaces the derived one only where, on every rank, it reads exactly the
regions the derived one does: nothing is taken from the scheme that vLLM did not show.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

from shardprep.errors import PlanError
from shardprep.plan.archs.base import Layout, Param
from shardprep.plan.cuts import MODEL_DTYPE, Piece
from shardprep.plan.derived.regions import Fill, block_region
from shardprep.plan.layout import piece_blocks
from shardprep.plan.quant import Scheme, all_schemes, kv_cache, scheme_of, variant_schemes

Shapes = Mapping[str, tuple[int, ...]]


def model_scheme(config: Mapping[str, Any]) -> Scheme | None:
    """The scheme of config.json's `quantization_config`, or where it has none of its
    `text_config`'s (a multimodal model's), as vLLM reads it; None for an unquantized
    model or a scheme shardprep cannot lay out."""
    scheme = scheme_of(config)
    text = config.get("text_config")
    if scheme is None and isinstance(text, Mapping):
        scheme = scheme_of(text)
    return None if scheme is None or scheme.problem else scheme


def in_scheme_terms(layout: Layout, scheme: Scheme, shapes: Shapes, tp: int) -> Layout:
    """`layout` with the parameters `scheme` (or one of its `variants`) makes of each
    derived weight in its pieces, where they read what the derived ones read on every rank."""
    derived = {param.name: param for param in layout.params}
    experts = {
        piece.source
        for param in layout.params
        for piece in param.pieces
        if piece.expert is not None
    }
    schemes = (scheme, *variants(scheme, experts))
    replaced: dict[str, Param] = {}
    for param in layout.params:
        if param.name in replaced:
            continue
        for candidate in schemes:
            mine = _scheme_params(param, candidate, derived, shapes, tp)
            if mine:
                replaced |= {p.name: p for p in mine}
                break
    replaced |= _kv_cache_scales(layout, scheme, shapes, tp)
    if not replaced:
        return layout
    params = tuple(replaced.get(param.name, param) for param in layout.params)
    return dataclasses.replace(layout, params=params)


def variants(scheme: Scheme, experts: Collection[str]) -> list[Scheme]:
    """The schemes by which another vLLM quantization method loads a checkpoint of
    `scheme`'s: its subclasses of the same name, and those a family names for it
    (`Family.quant_scheme`), each told where the routed experts' weights are (`experts`,
    the derived layout's). vLLM's parameter names and regions tell which one it took."""
    kind = type(scheme)
    if not dataclasses.is_dataclass(scheme):
        return []
    fields = {f.name: getattr(scheme, f.name) for f in dataclasses.fields(scheme)}
    named = variant_schemes()
    return [
        cls(**fields).for_experts(experts)
        for cls in all_schemes()
        if cls is not kind and issubclass(cls, kind) and (cls.name == kind.name or cls in named)
    ]


def _scheme_params(
    param: Param, scheme: Scheme, derived: Mapping[str, Param], shapes: Shapes, tp: int
) -> list[Param]:
    """The parameters `scheme` makes of the weight `param` holds, where each is a derived
    parameter of the same name that reads the same regions on every rank; none otherwise."""
    weight = _weight(param, scheme, shapes)
    if weight is None:
        return []
    name, pieces, weights = weight
    try:
        made, _ = scheme.params(name, pieces, {**shapes, **weights}, tp, tp)
    except (PlanError, KeyError, ValueError):  # not a weight the scheme quantizes
        return []
    found = [derived.get(name) for name, _, _ in made]
    if len(made) < 2 or any(p is None for p in found):
        return []
    mine = [Param(name, pieces, param.stages, dtype) for name, pieces, dtype in made]
    if all(_same_reads(a, b, shapes, tp) for a, b in zip(mine, found, strict=True)):
        return mine
    return []


def _kv_cache_scales(layout: Layout, scheme: Scheme, shapes: Shapes, tp: int) -> dict:
    """The KV-cache scales a checkpoint ships, as the scheme places them (quant/kv_cache.py),
    where vLLM loads each into the parameter the scheme names and nothing else into it."""
    if not scheme.kv_cache_scales:
        return {}
    derived = {param.name: param for param in layout.params}
    placed = kv_cache.kv_cache_params(shapes, ((p.name, p.stages) for p in layout.params))
    mine = [Param(name, (piece,), on, kv_cache.SCALE_DTYPE) for name, piece, on in placed]
    return {p.name: p for p in mine if _same_reads(p, derived.get(p.name), shapes, tp)}


def _weight(
    param: Param, scheme: Scheme, shapes: Shapes
) -> tuple[str, tuple[Piece, ...], dict[str, tuple[int, ...]]] | None:
    """The quantized weight a derived parameter would hold: vLLM's name of it (the
    parameter's, less the ending its sources share where it has it: a scheme may name the
    parameter of `x.weight_packed` after the weight alone), its pieces (the derived ones'
    cuts, of the weights their sources store) and the weights' shapes, as the scheme
    stores them (`x.weight_packed` [N, K/2] of `x.weight` [N, K]); None where its sources
    store no weight of the scheme's or do not all end alike."""
    logical = [scheme.logical(piece.source) for piece in param.pieces]
    pairs = list(zip(param.pieces, logical, strict=True))
    if not all(piece.source.startswith(w) for piece, w in pairs):
        return None
    suffixes = {piece.source[len(w) :] for piece, w in pairs}
    if len(suffixes) != 1:
        return None
    weights = {w: scheme.weight_shape(w, shapes) for w in logical}
    if not all(logical) or any(shape is None for shape in weights.values()):
        return None
    pieces = tuple(piece._replace(source=w) for piece, w in pairs)
    name = param.name.removesuffix(suffixes.pop())
    return name, pieces, {w: s for w, s in weights.items() if s is not None}


def _same_reads(mine: Param, derived: Param | None, shapes: Shapes, tp: int) -> bool:
    if derived is None or mine.stages != derived.stages:
        return False
    # A derived parameter without a dtype is held in the model's (its placeholders are
    # in the model's dtype), which is what the scheme's MODEL_DTYPE says.
    if mine.dtype != derived.dtype and (mine.dtype, derived.dtype) != (MODEL_DTYPE, None):
        return False
    if len(mine.pieces) != len(derived.pieces):
        return False
    for a, b in zip(mine.pieces, derived.pieces, strict=True):
        for rank in range(tp):
            reads = _reads(a, shapes, tp, rank)
            if reads is None or reads != _reads(b, shapes, tp, rank):
                return False
    return True


def _reads(piece: Piece, shapes: Shapes, tp: int, rank: int) -> list[Fill] | None:
    """What a piece reads on one rank, in the normal form; None where it has none."""
    if piece.source not in shapes:
        return None
    shape = tuple(shapes[piece.source])  # () for a scalar: one value
    try:
        blocks = piece_blocks(piece, shape, tp, rank)
        return [block_region(block, shape, math.prod(shape[1:])) for block in blocks]
    except PlanError:
        return None
