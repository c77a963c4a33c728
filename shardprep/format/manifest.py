"""The manifest: the contract between the converter and the loader.

`shardprep.json` at the artifact's root, written last: its presence means complete.
Frozen dataclasses, `to_json`/`from_json`; an unknown format or key is an error.
The JSON Schema in docs/manifest.schema.json describes the same document.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from shardprep import safefs
from shardprep.constants import FORMAT, MANIFEST_NAME, MAX_JSON_BYTES
from shardprep.errors import ManifestError
from shardprep.format import jsonio
from shardprep.format.checks import check_consistency, check_document


@dataclass(frozen=True)
class SourceFile:
    path: str
    bytes: int
    sha256: str | None  # None when this conversion did not read the whole file


@dataclass(frozen=True)
class Source:
    model: str  # the folder or repo id given on the command line
    repo_id: str | None
    revision: str | None
    files: tuple[SourceFile, ...]


@dataclass(frozen=True)
class ParamSpec:
    dtype: str
    shape: tuple[int, ...]


# Layouts that some vLLM backends build differently before processing; an artifact holds
# the layout named here, and the loader names the setting when vLLM built another.
DEVICE_ASSUMPTIONS = {
    "moe_intermediate_padding": "none",  # FlashInfer TRT-LLM / ROCm AITER MoE round it up
    "fused_shared_experts": "none",  # ROCm AITER can append shared experts as routed ones
}


@dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture-of-experts model and how its ranks hold them."""

    num_experts: int
    expert_parallel: bool  # whole experts per rank (vLLM uses EP: the flag and tp x dp > 1)
    dp: int
    placement: str  # what vLLM places by: linear or round_robin
    requested_placement: str  # --expert-placement-strategy as given
    rank_experts: tuple[tuple[int, ...], ...]  # EP rank -> its global experts, local order
    assumptions: dict[str, str] = field(default_factory=lambda: dict(DEVICE_ASSUMPTIONS))


@dataclass(frozen=True)
class ModelEntry:
    role: str
    architecture: str
    dtype: str
    folder: str  # "" for the target, "draft" for the draft
    num_layers: int
    source: Source
    method: str | None = None  # the speculative method, for drafts
    # rank key "pp{P}-tp{T}" -> parameter name -> spec: what vLLM holds on that rank;
    # with dp > 1 the experts of each dp rank D are under "pp{P}-tp{T}-dp{D}"
    ranks: dict[str, dict[str, ParamSpec]] = field(default_factory=dict)
    spec_decode_only: tuple[tuple[str, int], ...] = ()
    shared_with_target: tuple[str, ...] = ()
    experts: Experts | None = None

    def rank_params(self, pp: int, tp: int, dp: int = 0) -> dict[str, ParamSpec]:
        """Every parameter the worker (pp, tp, dp) holds: its rank's, plus the experts
        of its dp rank where they are stored apart."""
        return {**self.ranks.get(rank_key(pp, tp), {}), **self.ranks.get(rank_key(pp, tp, dp), {})}


@dataclass(frozen=True)
class FileEntry:
    path: str
    role: str
    pp: int
    tp: int
    part: int
    bytes: int
    sha256: str
    codec: str = "none"
    stored_bytes: int | None = None
    stored_sha256: str | None = None
    dp: int | None = None  # the dp rank whose experts it holds; None: every dp rank reads it


@dataclass(frozen=True)
class ExtraFile:
    """A file copied from the source next to the shards (config, tokenizer)."""

    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    partition: tuple[int, ...]
    expert_parallel: bool = False


@dataclass(frozen=True)
class Manifest:
    format: str
    shardprep_version: str
    vllm_layout: str
    topology: Topology
    stages: tuple[int, ...]
    models: tuple[ModelEntry, ...]
    files: tuple[FileEntry, ...]
    extra_files: tuple[ExtraFile, ...] = ()

    def model(self, role: str) -> ModelEntry | None:
        return next((m for m in self.models if m.role == role), None)

    def rank_files(self, role: str, pp: int, tp: int, dp: int = 0) -> list[FileEntry]:
        """The files the worker (pp, tp, dp) reads: its rank's, then its dp rank's experts
        where they are stored apart."""
        found = [
            f
            for f in self.files
            if f.role == role and f.pp == pp and f.tp == tp and f.dp in (None, dp)
        ]
        return sorted(found, key=lambda f: (f.dp is not None, f.part))

    def to_json(self) -> str:
        data = _plain(asdict(self))
        for entry in data["files"]:
            if entry["dp"] is None:  # a file shared by every dp rank, as before dp existed
                del entry["dp"]
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and check a manifest (see manifest_check); any flaw is a ManifestError."""
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
        manifest = _build(cls, data)
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
    """Read a manifest file of any name, its size checked before it is read."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ManifestError(
            f"{where} is {size:,} bytes, over the {MAX_JSON_BYTES:,}-byte limit for a manifest"
        )
    return Manifest.from_json(path.read_bytes(), where=where)


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write atomically: a temporary name, then rename; the temporary file never stays."""
    path = folder / MANIFEST_NAME
    safefs.write_atomic(path, manifest.to_json(), prefix=".manifest-", suffix=".tmp")
    return path


def rank_key(pp: int, tp: int, dp: int | None = None) -> str:
    return f"pp{pp}-tp{tp}" if dp is None else f"pp{pp}-tp{tp}-dp{dp}"


def parse_rank_key(key: str) -> tuple[int, int]:
    """ "pp{P}-tp{T}" (or "pp{P}-tp{T}-dp{D}") -> (P, T)."""
    pp, tp, _ = split_rank_key(key)
    return pp, tp


def split_rank_key(key: str) -> tuple[int, int, int | None]:
    """ "pp{P}-tp{T}" -> (P, T, None); "pp{P}-tp{T}-dp{D}" -> (P, T, D)."""
    pp, tp, *dp = key.split("-")
    return int(pp[2:]), int(tp[2:]), int(dp[0][2:]) if dp else None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _build(cls: type, data: dict[str, Any]) -> Any:
    """A frozen dataclass from JSON that check_document has accepted."""
    return cls(**{name: _convert(cls, name, value) for name, value in data.items()})


_NESTED: dict[tuple[type, str], type] = {
    (Manifest, "topology"): Topology,
    (Manifest, "models"): ModelEntry,
    (Manifest, "files"): FileEntry,
    (Manifest, "extra_files"): ExtraFile,
    (ModelEntry, "source"): Source,
    (ModelEntry, "experts"): Experts,
    (Source, "files"): SourceFile,
}


def _convert(cls: type, name: str, value: Any) -> Any:
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
    if isinstance(value, list):
        return tuple(value)
    return value
