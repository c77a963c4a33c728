"""The manifest: the contract between the converter and the loader.

`shardprep.json` at the artifact's root, written last: its presence means complete. The
records are in `shardprep.format.records`; here they are read (size-limited, strict JSON,
every field checked by `shardprep.format.checks`) and written atomically.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path, PurePosixPath
from typing import Any

from shardprep import safefs
from shardprep.constants import FORMAT, MANIFEST_NAME, MAX_JSON_BYTES, REGIONS_NAME
from shardprep.errors import ManifestError
from shardprep.format import jsonio
from shardprep.format.checks import check_consistency
from shardprep.format.records import (
    Experts,
    ExtraFile,
    FileEntry,
    Manifest,
    ModelEntry,
    ParamSpec,
    PieceEntry,
    RegionsFile,
    ScaleEntry,
    Source,
    SourceFile,
    Topology,
    piece_of_json,
    rank_key,
    split_rank_key,
)
from shardprep.format.regions import read_regions, regions_document, regions_record
from shardprep.format.request import ConversionRequest
from shardprep.format.schema import check_document
from shardprep.format.vllm_layout import VllmLayout, legacy_layout

__all__ = [
    "ConversionRequest",
    "Experts",
    "ExtraFile",
    "FileEntry",
    "Manifest",
    "ModelEntry",
    "ParamSpec",
    "PieceEntry",
    "RegionsFile",
    "ScaleEntry",
    "Source",
    "SourceFile",
    "Topology",
    "VllmLayout",
    "check_relative",
    "load_manifest_file",
    "parse_manifest",
    "rank_key",
    "read_manifest",
    "read_regions",
    "split_rank_key",
    "write_manifest",
]


def parse_manifest(text: str | bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and check a manifest (see checks.py); any flaw is a ManifestError."""
    try:
        data = jsonio.parse(text, limit=MAX_JSON_BYTES)
    except jsonio.JSONProblem as exc:
        raise ManifestError(f"{where} {exc}; convert or fetch the artifact again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ManifestError(
            f"{where} has format {jsonio.shorten(repr(found))}; this shardprep reads "
            f"{FORMAT!r}. Convert the model again with this version, or install the "
            "shardprep that made it"
        )
    for entry in (*_dicts(data.get("files")), *_dicts(data.get("extra_files"))):
        if isinstance(entry.get("path"), str):
            check_relative(entry["path"], where)
    check_document(data, where)
    manifest = _build(Manifest, data)
    check_consistency(manifest, where)
    return manifest


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def check_relative(path: str, where: str) -> None:
    """Paths in a manifest are relative and stay inside the artifact."""
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path:
        raise ManifestError(
            f"{where} names {jsonio.shorten(repr(path))}, which leaves the artifact; refusing it"
        )


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{folder} has no {MANIFEST_NAME}: it is not a complete shardprep artifact. "
            f"Create it with `shardprep convert MODEL -o {folder}` (a rerun resumes)"
        )
    return load_manifest_file(path, str(path))


def load_manifest_file(path: Path, where: str) -> Manifest:
    """Read a manifest file of any name, its size checked before it is read. A process
    parses the same bytes once (a worker reads its manifest when it fetches, then when it
    loads the target, then the draft)."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ManifestError(
            f"{where} is {size:,} bytes, over the {MAX_JSON_BYTES:,}-byte limit for a manifest"
        )
    raw = path.read_bytes()
    key = hashlib.sha256(raw).digest()
    manifest = _PARSED.get(key)
    if manifest is None:
        manifest = parse_manifest(raw, where=where)
        if len(_PARSED) >= PARSED_KEPT:
            del _PARSED[next(iter(_PARSED))]
        _PARSED[key] = manifest
    return manifest


# The manifests this process parsed, by the sha256 of their bytes (records are frozen).
_PARSED: dict[bytes, Manifest] = {}
PARSED_KEPT = 4


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write atomically: a temporary name, then rename; the temporary file never stays.
    Pieces held inline go to the regions file first, which the manifest then names."""
    if any(model.pieces for model in manifest.models):
        raw = regions_document(manifest.models)
        safefs.write_atomic(folder / REGIONS_NAME, raw, prefix=".regions-", suffix=".tmp")
        manifest = dataclasses.replace(
            manifest,
            regions=regions_record(raw, manifest.models),
            models=tuple(
                dataclasses.replace(model, pieces={}, source_shapes={}) for model in manifest.models
            ),
        )
    path = folder / MANIFEST_NAME
    safefs.write_atomic(path, manifest.to_json(), prefix=".manifest-", suffix=".tmp")
    return path


def _build(cls: type, data: dict[str, Any]) -> Any:
    """A frozen dataclass from JSON that check_document has accepted."""
    return cls(**{name: _convert(cls, name, value) for name, value in data.items()})


_NESTED: dict[tuple[type, str], type] = {
    (Manifest, "topology"): Topology,
    (Manifest, "models"): ModelEntry,
    (Manifest, "files"): FileEntry,
    (Manifest, "extra_files"): ExtraFile,
    (Manifest, "request"): ConversionRequest,
    (Manifest, "vllm_layout"): VllmLayout,
    (Manifest, "regions"): RegionsFile,
    (ModelEntry, "source"): Source,
    (ModelEntry, "experts"): Experts,
    (Source, "files"): SourceFile,
}


def _convert(cls: type, name: str, value: Any) -> Any:
    if cls is Manifest and name == "vllm_layout" and isinstance(value, str):
        return legacy_layout()  # check_document accepts only the legacy string
    nested = _NESTED.get((cls, name))
    if nested is not None and value is not None:
        if isinstance(value, list):
            return tuple(_build(nested, v) for v in value)
        return _build(nested, value)
    if name == "rank_experts":
        return tuple(tuple(int(e) for e in rank) for rank in value)
    if name == "spec_decode_only":
        return tuple((n, s) for n, s in value)
    if name == "ranks":
        return {
            key: {p: ParamSpec(spec["dtype"], tuple(spec["shape"])) for p, spec in params.items()}
            for key, params in value.items()
        }
    if cls is RegionsFile and name == "mx":
        return tuple(piece_of_json(piece) for piece in value)
    if name == "pieces":
        return {p: tuple(piece_of_json(piece) for piece in pieces) for p, pieces in value.items()}
    if name == "source_shapes":
        return {s: tuple(shape) for s, shape in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value
