"""The regions file: where every part of every rank tensor came from.

`shardprep.regions.json`, beside the manifest, holds each model's pieces (per parameter,
its source tensors and how every rank cuts them) and the shapes of their sources: what a
loader needs to cut a rank of another topology out of the artifact, and nothing a worker
at the artifact's own topology reads. The manifest names it (`Manifest.regions`: size,
sha256, the cuts it uses), so a reader opens it only when it must, and checks it then.

A run of expert pieces that differ only in the expert's number (one entry per expert of a
1 TB model: hundreds of thousands) is written once, as a range:
`{"experts": [first, stop], "each": [[pattern, cut, {...}], ...]}`, `{e}` in each pattern
standing for the expert's number; their sources' shapes, when equal, as
`[pattern, first, stop, shape]` in `expert_shapes`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardprep.constants import MAX_JSON_BYTES, REGIONS_NAME
from shardprep.errors import ManifestError
from shardprep.format import jsonio
from shardprep.format.checks import piece_problems
from shardprep.format.records import (
    Manifest,
    ModelEntry,
    PieceEntry,
    RegionsFile,
    mx_pieces,
    piece_json,
    piece_of_json,
)
from shardprep.format.regions_schema import check_regions
from shardprep.format.schema import ADVICE

REGIONS_FORMAT = "shardprep-regions/1"
EXPERT = "{e}"
Shapes = Mapping[str, Sequence[int]]
# role -> (pieces, source shapes)
Regions = dict[str, tuple[dict[str, tuple[PieceEntry, ...]], dict[str, tuple[int, ...]]]]


def regions_document(models: Sequence[ModelEntry]) -> bytes:
    """The regions file of `models` (those that record pieces), ranges folded."""
    entries = []
    for model in models:
        if not model.pieces:
            continue
        pieces, ranges = {}, []
        for name, param_pieces in model.pieces.items():
            pieces[name], found = _fold(param_pieces)
            ranges += found
        shapes, expert_shapes = _fold_shapes(model.source_shapes, ranges)
        entries.append(
            {"role": model.role, "pieces": pieces, "source_shapes": shapes,
             "expert_shapes": expert_shapes}
        )  # fmt: skip
    document = {"format": REGIONS_FORMAT, "models": entries}
    return (json.dumps(document, separators=(",", ":"), sort_keys=True) + "\n").encode()


def regions_record(raw: bytes, models: Sequence[ModelEntry]) -> RegionsFile:
    """What the manifest records of the regions file `raw` of `models`."""
    cuts = {p.cut for model in models for pieces in model.pieces.values() for p in pieces}
    roles = tuple(model.role for model in models if model.pieces)
    digest = hashlib.sha256(raw).hexdigest()
    return RegionsFile(
        REGIONS_NAME, len(raw), digest, tuple(sorted(cuts)), roles, mx_pieces(models)
    )


def read_regions(folder: Path, manifest: Manifest) -> Manifest:
    """`manifest` with each model's pieces and source shapes, read from its regions file
    in `folder` (checked against the size and sha256 the manifest records); as it is when
    it records them inline (artifacts made before the regions file) or not at all."""
    record = manifest.regions
    if record is None:
        return manifest
    path = folder / record.path
    where = str(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ManifestError(
            f"{folder} lacks {record.path}, which the manifest names: the artifact serves "
            "only its own topology without it; convert or fetch the artifact again"
        ) from None
    if size != record.bytes or size > MAX_JSON_BYTES:
        raise ManifestError(
            f"{where} has {size:,} bytes, the manifest records {record.bytes:,} (at most "
            f"{MAX_JSON_BYTES:,}); convert or fetch the artifact again"
        )
    regions = _PARSED.get(record.sha256)
    if regions is None:
        most = max((m.experts.num_experts for m in manifest.models if m.experts), default=0)
        raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != record.sha256:
            raise ManifestError(
                f"{where} does not match the sha256 the manifest records; convert or fetch "
                "the artifact again"
            )
        regions = parse_regions(raw, where, max_experts=most)
        _PARSED.clear()
        _PARSED[record.sha256] = regions
    if sorted(regions) != sorted(record.roles):
        raise ManifestError(
            f"{where} holds the pieces of {sorted(regions)}, the manifest names "
            f"{sorted(record.roles)}; convert or fetch the artifact again"
        )
    models = []
    for model in manifest.models:
        pieces, shapes = regions.get(model.role, ({}, {}))
        models.append(dataclasses.replace(model, pieces=pieces, source_shapes=shapes))
    problems = [p for model in models for p in piece_problems(model)]
    if problems:
        raise ManifestError(f"{where}: {'; '.join(problems[:3])}; {ADVICE}")
    return dataclasses.replace(manifest, models=tuple(models))


# The regions files this process read, by sha256 (a worker loading its target and its
# draft at another topology reads the file once); the last one only, they are large.
_PARSED: dict[str, Regions] = {}


def parse_regions(raw: bytes, where: str = REGIONS_NAME, max_experts: int | None = None) -> Regions:
    """role -> (pieces, source shapes) of a regions file, ranges unfolded (of at most
    `max_experts` experts where given); any flaw is a ManifestError."""
    try:
        data = jsonio.parse(raw, limit=MAX_JSON_BYTES)
    except jsonio.JSONProblem as exc:
        raise ManifestError(f"{where} {exc}; convert or fetch the artifact again") from None
    check_regions(data, where, REGIONS_FORMAT, max_experts)
    found = {}
    for entry in data["models"]:
        pieces = {name: tuple(_unfold(items)) for name, items in entry["pieces"].items()}
        shapes = {name: tuple(shape) for name, shape in entry["source_shapes"].items()}
        for pattern, first, stop, shape in entry["expert_shapes"]:
            shape = tuple(shape)
            shapes.update((pattern.replace(EXPERT, str(e)), shape) for e in range(first, stop))
        if entry["role"] in found:
            raise ManifestError(f"{where} lists the {entry['role']} twice; convert again")
        found[entry["role"]] = (pieces, shapes)
    return found


def _unfold(items: Sequence[Any]) -> Iterator[PieceEntry]:
    for item in items:
        if isinstance(item, list):
            yield piece_of_json(item)
            continue
        template = [piece_of_json(p) for p in item["each"]]
        for expert in range(*item["experts"]):
            yield from _expand(template, expert)


def _fold(pieces: Sequence[PieceEntry]) -> tuple[list[Any], list[tuple[list[PieceEntry], range]]]:
    """A parameter's pieces as JSON, each run of two or more experts whose pieces differ
    only in the expert's number as one range; and those runs (template, experts)."""
    groups = _expert_groups(pieces)
    out: list[Any] = []
    ranges = []
    i = 0
    while i < len(groups):
        expert, group = groups[i]
        template = _template(group, expert) if expert is not None else None
        j = i + 1
        if expert is not None and template is not None:
            while (
                j < len(groups)
                and groups[j][0] == expert + (j - i)
                and _expand(template, groups[j][0]) == groups[j][1]
            ):
                j += 1
            if j - i > 1:
                out.append(
                    {"experts": [expert, expert + j - i], "each": [_json(p) for p in template]}
                )
                ranges.append((template, range(expert, expert + j - i)))
                i = j
                continue
        out += [_json(p) for p in group]
        i = j
    return out, ranges


def _expert_groups(pieces: Sequence[PieceEntry]) -> list[tuple[int | None, list[PieceEntry]]]:
    """Consecutive pieces of one expert together (None: a piece of no expert, alone)."""
    groups: list[tuple[int | None, list[PieceEntry]]] = []
    for piece in pieces:
        if piece.expert is not None and groups and groups[-1][0] == piece.expert:
            groups[-1][1].append(piece)
        else:
            groups.append((piece.expert, [piece]))
    return groups


def _template(group: list[PieceEntry], expert: int) -> list[PieceEntry] | None:
    """The group with the expert's number in each source name as `{e}` (its last dotted
    part that is the number), or None where a name has none or holds a brace already."""
    template = []
    for piece in group:
        parts = piece.source.split(".")
        if "{" in piece.source or "}" in piece.source or str(expert) not in parts:
            return None
        at = len(parts) - 1 - parts[::-1].index(str(expert))
        pattern = ".".join([*parts[:at], EXPERT, *parts[at + 1 :]])
        template.append(dataclasses.replace(piece, source=pattern, expert=None))
    return template if _expand(template, expert) == group else None


def _expand(template: list[PieceEntry], expert: int | None) -> list[PieceEntry]:
    number = str(expert)
    return [
        dataclasses.replace(p, source=p.source.replace(EXPERT, number), expert=expert)
        for p in template
    ]


def _json(piece: PieceEntry) -> list[Any]:
    return piece_json(dataclasses.asdict(piece))


def _fold_shapes(
    shapes: Shapes, ranges: Sequence[tuple[list[PieceEntry], range]]
) -> tuple[dict[str, list[int]], list[list[Any]]]:
    """Source shapes as JSON: those of a range's sources, when all equal, once per
    pattern and range; the rest by name."""
    plain = {name: list(shape) for name, shape in shapes.items()}
    folded: dict[tuple[str, int, int], list[int]] = {}
    for template, experts in ranges:
        for piece in template:
            key = (piece.source, experts.start, experts.stop)
            names = [piece.source.replace(EXPERT, str(e)) for e in experts]
            if key in folded or not all(name in plain for name in names):
                continue
            first = plain[names[0]]
            if all(plain[name] == first for name in names):
                folded[key] = first
                for name in names:
                    del plain[name]
    return plain, [[*key, shape] for key, shape in sorted(folded.items())]
