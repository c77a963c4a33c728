"""The manifest's records: frozen dataclasses, and their JSON (`Manifest.to_json`).

Reading and checking a manifest is `shardprep.format.manifest`; the JSON Schema in
docs/manifest.schema.json describes the same document.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shardprep.errors import PlanError
from shardprep.format.cut_names import MX_BLOCK, MX_CUTS, MXFP4_PADDING_AT_LOAD
from shardprep.format.request import ConversionRequest
from shardprep.format.vllm_layout import MOE_ASSUMPTIONS, VllmLayout


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


@dataclass(frozen=True)
class ScaleEntry:
    """What a block-scale piece scales: a 2-D weight of `shape` cut by `cut`, quantized
    in blocks of `block`, on the finer `grid` vLLM uses where it refines the blocks."""

    shape: tuple[int, int]
    cut: str
    block: tuple[int, int]
    grid: tuple[int, int] | None = None
    heads: int = 0  # KV heads, for a weight cut kv_heads


@dataclass(frozen=True)
class PieceEntry:
    """One part of a parameter: its source tensor and how every rank cuts it. With the
    source shapes this lets a loader derive the region of any rank at any tp."""

    source: str
    cut: str
    heads: int = 0  # KV heads (kv_heads, qkv_heads); parts (parts_rows); rows of q
    # (qkv_rows); the multiple of rows (align_rows); zero rows (zero_rows)
    expert: int | None = None  # the global expert id, for a piece of an expert stack
    scale_of: ScaleEntry | None = None  # for the block_scale cut
    q_heads: int = 0  # query heads (qkv_heads)


@dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture-of-experts model and how its ranks hold them."""

    num_experts: int
    expert_parallel: bool  # whole experts per rank (vLLM uses EP: the flag and tp x dp > 1)
    dp: int
    placement: str  # what vLLM places by: linear or round_robin
    requested_placement: str  # --expert-placement-strategy as given
    rank_experts: tuple[tuple[int, ...], ...]  # EP rank -> its global experts, local order
    assumptions: dict[str, str] = field(default_factory=lambda: dict(MOE_ASSUMPTIONS))


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
    # vLLM's quantization method of the stored weights (e.g. "fp8"); None: unquantized
    quantization: str | None = None
    # parameter name -> its pieces, and source tensor name -> its shape: where every
    # part of every rank tensor came from. Empty in artifacts made before they were
    # recorded, which serve only their own topology.
    pieces: dict[str, tuple[PieceEntry, ...]] = field(default_factory=dict)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

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
class RegionsFile:
    """The regions file beside the manifest (`shardprep.format.regions`): the pieces and
    source shapes of the models in `roles`, and the kinds of cut they use."""

    path: str
    bytes: int
    sha256: str
    cuts: tuple[str, ...]
    roles: tuple[str, ...]
    # The distinct cuts and scales of its MXFP4 pieces, sources left out: which tps the
    # experts' 32-blocks serve (`Manifest.served_tps`).
    mx: tuple[PieceEntry, ...] = ()


@dataclass(frozen=True)
class Topology:
    """tp x pp, with the explicit number of layers on each stage."""

    tp: int
    pp: int
    partition: tuple[int, ...]
    expert_parallel: bool = False  # --enable-expert-parallel was asked for

    def layer_range(self, stage: int) -> tuple[int, int]:
        start = sum(self.partition[:stage])
        return start, start + self.partition[stage]

    def stage_of_layer(self, layer: int) -> int:
        for stage in range(self.pp):
            start, end = self.layer_range(stage)
            if start <= layer < end:
                return stage
        raise PlanError(f"layer {layer} is outside the {sum(self.partition)} layers of the model")

    @property
    def last_stage(self) -> int:
        return self.pp - 1


@dataclass(frozen=True)
class Manifest:
    format: str
    shardprep_version: str
    vllm_layout: VllmLayout
    topology: Topology
    stages: tuple[int, ...]
    models: tuple[ModelEntry, ...]
    files: tuple[FileEntry, ...]
    extra_files: tuple[ExtraFile, ...] = ()
    request: ConversionRequest | None = None  # None in artifacts made before it was recorded
    # The plan and its sources' identity, hashed: a rerun keeps the files only if it matches.
    plan_fingerprint: str | None = None
    # Where the models' pieces are, when not inline (artifacts before it held them here).
    regions: RegionsFile | None = None

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

    @property
    def served_tps(self) -> tuple[int, ...]:
        """The tp sizes this artifact serves at any pp (the divisors of its tp, when every
        model records its pieces and every stage is here); () for its own topology only."""
        if not self.models or not all(self.records_pieces(m) for m in self.models):
            return ()
        if tuple(self.stages) != tuple(range(self.topology.pp)):
            return ()
        mx = self._mx_scales
        if "zero_rows" in self._cuts or any(of.grid for _, of in mx):  # padded for this tp
            return ()
        # MXFP4 experts: the 32-blocks of each stack's intermediate size (`mx_w2`: [H, I])
        blocks = {of.shape[1] // MX_BLOCK for cut, of in mx if cut == "mx_w2"}
        tp = self.topology.tp
        return tuple(
            d for d in range(1, tp + 1) if tp % d == 0 and all(_mx_nested(b, tp, d) for b in blocks)
        )

    @property
    def padded_for_tp(self) -> bool:
        """Whether expert stacks hold a padding baked in as one MoE backend pads them at
        this tp (MXFP4 with --mxfp4-pad): another tp pads other sizes, which no rank
        tensor here holds."""
        return any(of.grid for _, of in self._mx_scales)

    @property
    def _mx_scales(self) -> list[tuple[str, ScaleEntry]]:
        pieces = self.regions.mx if self.regions is not None else mx_pieces(self.models)
        return [(piece.cut, piece.scale_of) for piece in pieces if piece.scale_of is not None]

    def served_backends(self) -> str:
        """The MoE kernel backends this artifact serves, as users read them."""
        padding = {m.experts.assumptions.get("mxfp4_padding") for m in self.models if m.experts}
        baked = sorted(p for p in padding if p is not None and p != MXFP4_PADDING_AT_LOAD)
        if baked:
            return (
                f"the MXFP4 MoE backends whose padding holds the baked-in --mxfp4-pad "
                f"{', '.join(baked)} (the same or coarser alignments)"
            )
        if None in padding:  # experts vLLM does not pad for MXFP4 kernels
            return (
                "every kernel backend that keeps the expert stacks' sizes (not FlashInfer "
                "TRT-LLM or ROCm AITER MoE, which pad unquantized experts)"
            )
        return "every kernel backend (what a backend repacks or pads is done at load)"

    @property
    def whole_experts(self) -> bool:
        """Whether each rank holds whole experts (converted with expert parallelism): vLLM
        takes them so at tp1, or with expert parallelism; no rank file holds part of one."""
        return any(m.experts is not None and m.experts.expert_parallel for m in self.models)

    def records_pieces(self, model: ModelEntry) -> bool:
        """Whether the pieces of `model` are recorded (inline or in the regions file)."""
        return bool(model.pieces) or (self.regions is not None and model.role in self.regions.roles)

    @property
    def side_files(self) -> tuple[ExtraFile, ...]:
        """The files beside the shards that every copy of the artifact holds: those copied
        from the source, and the regions file."""
        regions = self.regions
        mine = (ExtraFile(regions.path, regions.bytes, regions.sha256),) if regions else ()
        return (*self.extra_files, *mine)

    @property
    def _cuts(self) -> set[str]:
        if self.regions is not None:
            return set(self.regions.cuts)
        return {
            piece.cut
            for model in self.models
            for pieces in model.pieces.values()
            for piece in pieces
        }

    def served_topologies(self) -> str:
        """The topologies this artifact serves, as users read them."""
        topo = self.topology
        if self.served_tps:
            served = f"tp {', '.join(map(str, self.served_tps))} x any pp"
            with_ep = [str(tp) for tp in self.served_tps if tp > 1]
            if self.whole_experts and with_ep:
                served += (
                    f" (tp {', '.join(with_ep)} with --enable-expert-parallel: each rank "
                    "holds whole experts)"
                )
            return served
        own = f"tp{topo.tp} x pp{topo.pp} only"
        if self.padded_for_tp:
            return f"{own} (its MXFP4 experts are padded for tp{topo.tp})"
        if tuple(self.stages) != tuple(range(topo.pp)) and all(
            self.records_pieces(m) for m in self.models
        ):
            return f"{own} (it holds stage(s) {', '.join(map(str, self.stages))})"
        if "zero_rows" in self._cuts:
            return f"{own} (made before shardprep aligned its zero rows for each tp)"
        return f"{own} (made before shardprep recorded where its pieces came from)"

    def to_json(self) -> str:
        data = _plain(asdict(self))
        for entry in data["files"]:
            if entry["dp"] is None:  # a file shared by every dp rank, as before dp existed
                del entry["dp"]
        if data["regions"] is None:
            del data["regions"]
        else:
            data["regions"]["mx"] = [piece_json(p) for p in data["regions"]["mx"]]
        for model in data["models"]:
            model["pieces"] = {
                name: [piece_json(p) for p in pieces] for name, pieces in model["pieces"].items()
            }
            for key in ("pieces", "source_shapes"):
                if not model[key]:  # in the regions file, or not recorded
                    del model[key]
        return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _mx_nested(blocks: int, tp: int, served: int) -> bool:
    """Whether each rank of tp `served` holds the MXFP4 blocks of the tp ranks it is made
    of and no other: vLLM gives every rank ceil(blocks / tp) 32-blocks (the last ones
    fewer), so a coarser tp's boundaries need not be a finer one's (90 blocks at tp8 are
    12 a rank, at tp4 23)."""
    per, coarse, k = -(-blocks // tp), -(-blocks // served), tp // served
    return all(min(r * coarse, blocks) == min(r * k * per, blocks) for r in range(served + 1))


def mx_pieces(models: Sequence[ModelEntry]) -> tuple[PieceEntry, ...]:
    """The distinct cuts and scales of the models' MXFP4 pieces, without their sources."""
    found = {
        PieceEntry("", piece.cut, scale_of=piece.scale_of)
        for model in models
        for pieces in model.pieces.values()
        for piece in pieces
        if piece.cut in MX_CUTS and piece.scale_of is not None
    }
    return tuple(sorted(found, key=repr))


def piece_json(piece: dict[str, Any]) -> list[Any]:
    """A piece as `[source, cut]`, with `{heads, expert, scale_of, q_heads}` third where
    any is set: a 1 TB model has hundreds of thousands of pieces."""
    extra = {k: piece[k] for k in ("heads", "scale_of", "q_heads") if piece.get(k)}
    if piece["expert"] is not None:
        extra["expert"] = piece["expert"]
    if extra.get("scale_of") and extra["scale_of"]["grid"] is None:
        del extra["scale_of"]["grid"]
    if extra.get("scale_of") and not extra["scale_of"].get("heads"):
        extra["scale_of"].pop("heads", None)
    return [piece["source"], piece["cut"], *([extra] if extra else [])]


def piece_of_json(value: list[Any]) -> PieceEntry:
    extra = value[2] if len(value) > 2 else {}
    of = extra.get("scale_of")
    scale = None
    if of is not None:
        grid = tuple(of["grid"]) if of.get("grid") is not None else None
        shape, block = tuple(of["shape"]), tuple(of["block"])
        scale = ScaleEntry(shape, of["cut"], block, grid, of.get("heads", 0))
    heads, q_heads = extra.get("heads", 0), extra.get("q_heads", 0)
    return PieceEntry(value[0], value[1], heads, extra.get("expert"), scale, q_heads)


def rank_key(pp: int, tp: int, dp: int | None = None) -> str:
    return f"pp{pp}-tp{tp}" if dp is None else f"pp{pp}-tp{tp}-dp{dp}"


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
