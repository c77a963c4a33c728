"""From what vLLM's `load_weights` did on each rank to plan pieces: every parameter's
pieces, each with the one cut (plan/cuts.py) that gives, on every rank, exactly the
regions vLLM copied. Rank records arrive one at a time and are dropped once read, so
memory holds the candidate cuts, not the programs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardprep.errors import PlanError, summarize
from shardprep.format.dtypes import FLOAT_DTYPES
from shardprep.plan.archs.base import Layout, Param
from shardprep.plan.cuts import MODEL_DTYPE, Cut, Piece
from shardprep.plan.derived.experts import expert_groups, one_value_each, per_expert, value_piece
from shardprep.plan.derived.overwrites import final_writes
from shardprep.plan.derived.padding import align_piece, built_tails
from shardprep.plan.derived.qkv import qkv_candidates
from shardprep.plan.derived.quant import model_scheme
from shardprep.plan.derived.regions import (
    Fill,
    block_region,
    contiguous_span,
    normal,
    zeros,
)
from shardprep.plan.derived.regions import merged as _merged
from shardprep.plan.derived.shapes import one_value
from shardprep.plan.layout import block_shape, piece_blocks

UNREAD = "vLLM's load_weights does not read it"
OVERWRITTEN = "vLLM's load_weights copies it into {}, then overwrites that with a later write"
# The cuts a derived piece may have, in the order they are preferred where several give
# the same regions at the derived tp (ROWS over KV_HEADS while tp divides the heads).
SIMPLE_CUTS = (Cut.REPLICATE, Cut.ROWS, Cut.COLS, Cut.VOCAB, Cut.PADDED_VOCAB)
PARTS = (2, 3)
STACKED_CUTS = (Cut.EXPERT_HALVES_ROWS, Cut.EXPERT_COLS, Cut.EXPERT_COLS_T, Cut.EXPERT_ROWS_T)
VECTOR_CUTS = (Cut.EXPERT_ROW, Cut.EXPERT_ROW_FIRST)  # an expert's row of an [E, B] source


@dataclass
class _PieceState:
    source: str
    expert: int | None
    candidates: list[Piece]


@dataclass
class _ParamState:
    dtype: str
    shape: tuple[int, ...]
    pieces: list[_PieceState]
    stages: set[int] = field(default_factory=set)
    padding: int = 0  # the most zero rows a rank ends with, built and never loaded
    # (loaded rows, built rows) of a rank whose last rows are built zeros, at any tp
    aligned: set[tuple[int, int]] = field(default_factory=set)


def candidates(source: str, shape: Sequence[int], expert: int | None, hints: Hints) -> list[Piece]:
    """The cuts to try for a source, preferred first. A source of exactly the KV heads'
    rows (GQA's k and v) prefers KV_HEADS, which ROWS equals while tp divides the heads; a
    source of the vocabulary's rows prefers VOCAB; a source of query, key and value heads
    (a fused GQA qkv) is tried as one (QKV_HEADS); an expert's piece of a source that
    stacks the experts (dim 0) reads its expert's matrix (EXPERT_HALVES_ROWS, ...)."""
    found = [Piece(source, cut, expert=expert) for cut in SIMPLE_CUTS]
    # VOCAB, which ROWS equals for a vocabulary of 64s (an expert's rows never are one)
    if expert is None and shape and shape[0] in (hints.vocab, hints.draft_vocab):
        found.insert(1, found.pop(3))
    if hints.heads and shape and shape[0] % hints.heads == 0:
        place = 1 if shape[0] == hints.rows and expert is None else 2
        found.insert(place, Piece(source, Cut.KV_HEADS, heads=hints.heads, expert=expert))
    found += [Piece(source, Cut.PARTS_ROWS, heads=parts, expert=expert) for parts in PARTS]
    if expert is not None and len(shape) == 3:  # the expert's matrix of a stacked source
        found += [Piece(source, cut, expert=expert) for cut in STACKED_CUTS]
    if expert is not None and len(shape) == 2:
        found += [Piece(source, cut, expert=expert) for cut in VECTOR_CUTS]
    if hints.rows and shape and shape[0] % (hints.q_heads + 2 * hints.heads) == 0:
        qkv = Piece(source, Cut.QKV_HEADS, hints.heads, expert, q_heads=hints.q_heads)
        found.append(qkv)
    return found


@dataclass(frozen=True)
class Hints:
    """What config.json says that tells equal cuts apart: the KV heads, their rows where
    they are fewer than the query heads, the vocabulary (0: no hint); and the query heads
    (which cut a fused GQA qkv). A model with a text model's config (a vision-language
    wrapper) reads them there, as vLLM's `hf_text_config` does."""

    heads: int
    rows: int
    vocab: int
    q_heads: int = 0
    draft_vocab: int = 0  # a draft's own vocabulary (an EAGLE3 draft's lm_head)

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Hints:
        text = config.get("text_config")
        config = {**config, **text} if isinstance(text, Mapping) else config

        def whole(key: str) -> int:
            value = config.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        heads, kv, hidden = (
            whole("num_attention_heads"),
            whole("num_key_value_heads"),
            whole("hidden_size"),
        )
        head_dim = whole("head_dim") or (hidden // heads if heads else 0)
        rows = kv * head_dim if 0 < kv < heads else 0
        return cls(kv, rows, whole("vocab_size"), heads, whole("draft_vocab_size"))


class Inference:
    """Reads rank records (`add`), then gives the layout they imply (`layout`)."""

    def __init__(
        self, config: Mapping[str, Any], sources: Mapping[str, tuple[str, tuple[int, ...]]], tp: int
    ) -> None:
        self.sources = sources
        self.tp = tp
        self.hints = Hints.of(config)
        self.scheme = model_scheme(config)
        self.params: dict[str, _ParamState] = {}
        self.read: set[str] = set()
        self.unloaded: set[str] = set()  # parameters vLLM's load_weights leaves as built
        self.overwritten: dict[str, str] = {}  # {source: param} only overwritten writes read
        self.model_dtype = ""

    def add(self, record: Mapping[str, Any]) -> None:
        """One rank's record: its parameters and the writes into them."""
        p, t = record["rank"]
        self.model_dtype = record["model_dtype"]
        writes: dict[str, list[tuple[int, int, Fill]]] = {name: [] for name in record["params"]}
        stacks = set(record.get("expert_stacks", ()))
        ops, overwritten = final_writes(record["ops"])  # what vLLM's state finally holds
        self.overwritten |= overwritten
        ops, tails = built_tails(ops, record["params"])
        for op in ops:
            kind, param, (offset, sizes, strides) = op[0], op[1], op[2]
            start, end = contiguous_span(normal(offset, sizes, strides), param)
            if start == end:
                continue
            if kind == "fill":
                if op[3] != 0:
                    raise PlanError(
                        f"vLLM's load_weights fills {param} with {op[3]}, a value no "
                        "checkpoint tensor holds; this architecture cannot be derived yet"
                    )
                fill = zeros(end - start)
            else:
                source, (s_offset, s_sizes, s_strides) = op[3], op[4]
                fill = (source, normal(s_offset, s_sizes, s_strides))
                self.read.add(source)
            if param in stacks:  # one write per expert
                writes[param] += per_expert((start, end, fill), tuple(record["params"][param][1]))
            else:
                writes[param].append((start, end, fill))
        for name, (dtype, shape) in record["params"].items():
            if not writes[name]:  # vLLM loads nothing into it (fp8's KV-cache scales)
                self.unloaded.add(name)
                continue
            padding = tails.get(name, 0)
            self._add_param(
                name, dtype, tuple(shape), writes[name], (p, t), padding, name in stacks
            )

    def padded(self) -> list[str]:
        """The parameters whose ranks end with zero rows vLLM builds and never loads."""
        return [name for name, state in self.params.items() if state.padding]

    def observe_rows(self, name: str, loaded: int, built: int) -> None:
        """A rank of another tp of `name` (a coarser one), built with these rows."""
        self.params[name].aligned.add((loaded, built))

    def _add_param(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        writes: list[tuple[int, int, Fill]],
        rank: tuple[int, int],
        padding: int,
        stack: bool = False,
    ) -> None:
        p, t = rank
        state = self.params.get(name)
        before = {piece.expert: piece.source for piece in (state.pieces if state else ())}
        by_expert = expert_groups(name, shape, writes, before, (p, t)) if stack else None
        groups = by_expert or _groups(name, shape, writes, p, t, padding)
        values = stack and one_value_each(shape, groups, self.sources)
        stacked = (len(shape) == 3 or stack) and all(g[1] is not None for g in groups)
        stacked = (stacked and len(groups) > 1) or by_expert is not None
        if state is None:
            pieces = [
                _PieceState(
                    source,
                    expert if stacked else None,
                    one_value(shape, source, self.sources[source][1])
                    + self._scheme_cuts(source, expert if stacked else None)
                    + candidates(
                        source, self.sources[source][1], expert if stacked else None, self.hints
                    )
                    + qkv_candidates(source, self.sources[source][1], fills, self.tp, t),
                )
                for source, expert, fills in groups
            ]
            if stacked and values:
                for piece in pieces:
                    piece.candidates = [value_piece(piece.source, piece.expert), *piece.candidates]
            _kv_heads_beside_queries(pieces, self.sources, self.hints.rows)
            state = self.params[name] = _ParamState(dtype, shape, pieces)
        if (dtype, shape) != (state.dtype, state.shape) or [g[0] for g in groups] != [
            piece.source for piece in state.pieces
        ]:
            raise PlanError(
                f"vLLM builds {name} differently on rank (pp {p}, tp {t}) than on the rank "
                "before it (its shape, dtype or the tensors it is made of); this "
                "architecture cannot be derived yet"
            )
        state.stages.add(p)
        state.padding = max(state.padding, padding)
        state.aligned.add((shape[0] - padding, shape[0]) if shape else (0, 0))
        width = _row_width(shape, stacked and len(shape) == 3)
        for piece, (_, _, fills) in zip(state.pieces, groups, strict=True):
            piece.candidates = [c for c in piece.candidates if self._matches(c, fills, width, t)]

    def _scheme_cuts(self, source: str, expert: int | None) -> list[Piece]:
        """The cuts a quantized checkpoint's scheme names for the source, tried first."""
        shape = self.sources[source][1]
        return [] if self.scheme is None else self.scheme.derived_cuts(source, shape, expert)

    def _matches(self, piece: Piece, fills: list[Fill], width: int, rank: int) -> bool:
        shape = self.sources[piece.source][1]
        try:
            blocks = piece_blocks(piece, shape, self.tp, rank)
            expected = [block_region(block, shape, width) for block in blocks]
        except PlanError:
            return False
        return _merged(expected) == _merged(fills)

    def layout(self, num_expert_group: int | None = None) -> Layout:
        problems: list[str] = []
        params = []
        experts = 0
        for name, state in self.params.items():
            chosen = []
            for piece in state.pieces:
                if not piece.candidates:
                    problems.append(
                        f"{name} <- {piece.source}: vLLM's load_weights copies regions no "
                        "cut of a plan expresses (not whole rows or columns per rank)"
                    )
                    continue
                chosen.append(piece.candidates[0])
            complete = bool(chosen) and len(chosen) == len(state.pieces)
            if state.padding and chosen:
                align = align_piece(name, state.aligned, chosen[-1])
                if isinstance(align, str):
                    problems.append(align)
                    complete = False
                else:
                    chosen.append(align)
            if state.pieces and state.pieces[0].expert is not None:
                experts = max(experts, state.shape[0])
            elif complete:
                problems += self._reshaped(name, state.shape, chosen)
            params.append(
                Param(name, tuple(chosen), tuple(sorted(state.stages)), self._dtype(state, chosen))
            )
        problems += [
            f"{name}: vLLM's load_weights fills it on some ranks and leaves it as built on others"
            for name in sorted(self.unloaded & set(self.params))
        ]
        if problems:
            raise PlanError(
                f"cannot derive the layout: {len(problems)} parameter(s): {summarize(problems)}"
            )
        why = {source: OVERWRITTEN.format(param) for source, param in self.overwritten.items()}
        skipped = {name: why.get(name, UNREAD) for name in self.sources if name not in self.read}
        return Layout(
            tuple(params), skipped, num_experts=experts, num_expert_group=num_expert_group
        )

    def _reshaped(self, name: str, shape: tuple[int, ...], pieces: list[Piece]) -> list[str]:
        """A parameter whose shape differs from the one its pieces give (the same values
        viewed otherwise, e.g. a source's leading unit dim squeezed away): one problem."""
        first = self.sources[pieces[0].source][1]
        read = [p for p in pieces if p.cut is not Cut.ALIGN_ROWS]
        blocks = [b for p in read for b in piece_blocks(p, self.sources[p.source][1], self.tp, 0)]
        rows = sum(b.height for b in blocks)
        rows += -rows % pieces[-1].heads if len(read) < len(pieces) else 0
        planned = (rows, *block_shape(blocks[0], first)[1:])
        if not first or planned == shape or pieces[0].cut is Cut.SCALAR:
            return []
        return [
            f"{name} <- {pieces[0].source}: vLLM holds {list(shape)} where the checkpoint's "
            f"regions give {list(planned)}, a reshape a plan of rows does not record"
        ]

    def _dtype(self, state: _ParamState, chosen: list[Piece]) -> str | None:
        """None where the parameter follows the model's dtype from a floating-point source,
        MODEL_DTYPE where it follows it from another (an int32 shape cast), unless its scheme
        holds its cut in the dtype vLLM gave it whatever the model's; its dtype otherwise (a
        quantized source's, held as the checkpoint stores it, too)."""
        fixed = self.scheme.derived_dtype(chosen[0].cut) if self.scheme and chosen else None
        if fixed == state.dtype:
            return fixed
        if state.dtype != self.model_dtype:
            return state.dtype
        return None if self.sources[state.pieces[0].source][0] in FLOAT_DTYPES else MODEL_DTYPE


def _groups(
    name: str,
    shape: tuple[int, ...],
    writes: list[tuple[int, int, Fill]],
    p: int,
    t: int,
    padding: int = 0,
) -> list[tuple[str, int | None, list[Fill]]]:
    """The writes in parameter order, grouped by source (zeros belong to the source before
    them), each group with the dim-0 index it lies in when it lies in one (an expert);
    the last `padding` rows are built zeros (padding.py), not written."""
    writes.sort(key=lambda w: w[0])
    total = math.prod(shape)
    per_row = total // shape[0] if shape and shape[0] else total
    total -= padding * per_row
    position = 0
    groups: list[tuple[str, int | None, list[Fill]]] = []
    for start, end, fill in writes:
        if start != position:
            what = "writes twice into" if start < position else "leaves unwritten part of"
            raise PlanError(
                f"vLLM's load_weights {what} {name} on rank (pp {p}, tp {t}); this "
                "architecture cannot be derived yet"
            )
        position = end
        index = start // per_row if (end - 1) // per_row == start // per_row else None
        source = fill[0]
        if source is None:
            if not groups:
                raise PlanError(f"vLLM's load_weights starts {name} with zeros; cannot derive it")
            groups[-1][2].append(fill)
            continue
        if groups and groups[-1][0] == source and not _next_expert(shape, groups[-1][1], index):
            groups[-1][2].append(fill)
            if groups[-1][1] != index:
                groups[-1] = (source, None, groups[-1][2])
        else:
            groups.append((source, index, [fill]))
    if position != total:
        raise PlanError(
            f"vLLM's load_weights leaves {total - position} of the {total} values of {name} "
            f"unwritten on rank (pp {p}, tp {t}); this architecture cannot be derived yet"
        )
    return groups


def _kv_heads_beside_queries(
    pieces: list[_PieceState], sources: Mapping[str, tuple[str, tuple[int, ...]]], kv_rows: int
) -> None:
    """A source of exactly the KV heads' rows is attention's k or v beside a part of more
    rows (the queries'): there KV_HEADS goes first (before REPLICATE, which it equals for
    one KV head, and ROWS, which it equals where tp divides the heads); elsewhere (an MLP
    of as many rows) after ROWS."""
    rows = [sources[piece.source][1][:1] for piece in pieces]
    for piece, own in zip(pieces, rows, strict=True):
        kv = next((c for c in piece.candidates if c.cut is Cut.KV_HEADS), None)
        if kv is None or not kv_rows or own != (kv_rows,) or piece.expert is not None:
            continue
        rest = [c for c in piece.candidates if c is not kv]
        if any(other > own for other in rows):
            piece.candidates = [kv, *rest]
            continue
        after = next((i + 1 for i, c in enumerate(rest) if c.cut is Cut.ROWS), len(rest))
        piece.candidates = [*rest[:after], kv, *rest[after:]]


def _next_expert(shape: tuple[int, ...], last: int | None, index: int | None) -> bool:
    """Whether a write into the next dim-0 row of a stack (its next expert) begins a
    group of its own though its source is the same (a checkpoint that stacks experts)."""
    return len(shape) == 3 and last is not None and index is not None and index != last


def _row_width(shape: tuple[int, ...], stacked: bool) -> int:
    dims = shape[2:] if stacked else shape[1:]
    return math.prod(dims)
