"""What ties a manifest's fields together, checked on every read after its shape
(`shardprep.format.schema`): what a schema cannot say. The topology adds
up, every (stage, tp rank) has its files and parameters, and every path is the one the
format gives that file, so a manifest cannot name the cache's own state or anything else.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from itertools import islice

from shardprep.constants import (
    COPIED_FILE_PATTERNS,
    DP_SHARD_PATTERN,
    DRAFT_DIR,
    DRAFT_SIDE_FILES,
    MANIFEST_NAME,
    SHARD_PATTERN,
    SHARDS_DIR,
)
from shardprep.errors import ManifestError
from shardprep.format.jsonio import shorten
from shardprep.format.records import Manifest, ModelEntry
from shardprep.format.schema import ADVICE


def check_consistency(manifest: Manifest, where: str) -> None:
    """What ties the fields together (see the module docstring)."""
    problems: list[str] = []
    topo = manifest.topology
    if len(topo.partition) != topo.pp:
        problems.append(f"topology.partition has {len(topo.partition)} entries for pp={topo.pp}")
    stages = list(manifest.stages)
    if not stages:
        problems.append("stages is empty")
    if stages != sorted(set(stages)) or any(s >= topo.pp for s in stages):
        problems.append(f"stages {stages[:8]} are not distinct stages of pp={topo.pp} in order")
    ranks = len(stages) * topo.tp
    if ranks > len(manifest.files):
        problems.append(
            f"{len(stages)} stage(s) at tp={topo.tp} need {ranks:,} ranks with files, "
            f"but files lists {len(manifest.files)}"
        )
    if problems:  # what follows walks every rank: only for a topology that adds up
        raise ManifestError(f"{where}: {'; '.join(problems[:3])}; {ADVICE}")
    problems += _model_problems(manifest)
    problems += _file_problems(manifest)
    problems += _extra_problems(manifest)
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ManifestError(f"{where}: {'; '.join(problems[:3])}{more}; {ADVICE}")


def _model_problems(manifest: Manifest) -> list[str]:
    problems = []
    roles = [m.role for m in manifest.models]
    if sorted(roles) not in (["target"], ["draft", "target"]):
        problems.append(f"models has the roles {roles[:4]}; one target and at most one draft")
    for model in manifest.models:
        folder = "" if model.role == "target" else DRAFT_DIR
        if model.folder != folder:
            problems.append(f"the {model.role} folder is {model.folder!r:.40}, not {folder!r}")
        if model.role == "target" and model.num_layers != sum(manifest.topology.partition):
            problems.append(
                f"the target has {model.num_layers} layers but topology.partition sums to "
                f"{sum(manifest.topology.partition)}"
            )
        wanted = {_rank_key(pp, tp) for pp, tp in _expected_ranks(manifest, model.role)}
        wanted |= set(_dp_keys(manifest, model))
        if set(model.ranks) != wanted:
            odd = sorted(set(model.ranks) ^ wanted)
            problems.append(
                f"the {model.role} ranks differ from the topology's stages and tp at "
                f"{', '.join(odd[:4])}"
            )
        empty = sorted(k for k, params in model.ranks.items() if not params)
        if empty:
            problems.append(f"the {model.role} rank(s) {', '.join(empty[:4])} hold no parameter")
        problems += piece_problems(model)
    return problems


def piece_problems(model: ModelEntry) -> list[str]:
    """Pieces, where recorded, cover every rank parameter, and name sources of known shape."""
    if not model.pieces and not model.source_shapes:
        return []
    problems = []
    held = {name for params in model.ranks.values() for name in params}
    bare = sorted(held - set(model.pieces))
    if bare:
        problems.append(f"the {model.role} parameter(s) {', '.join(bare[:3])} have no pieces")
    if any(not pieces for pieces in model.pieces.values()):
        problems.append(f"a {model.role} parameter has an empty list of pieces")
    unknown = sorted(
        {p.source for pieces in model.pieces.values() for p in pieces} - set(model.source_shapes)
    )
    if unknown:
        shown = ", ".join(shorten(s, 60) for s in unknown[:3])
        problems.append(f"the {model.role} pieces name source(s) {shown} of no recorded shape")
    return problems


def _dp_keys(manifest: Manifest, model: ModelEntry) -> dict[str, tuple[int, int, int]]:
    """The rank keys of experts stored per dp rank: every (tp rank, dp rank) of each stage
    that has any (a stage without MoE layers has none). Never more than one key beyond
    those present, however large a damaged manifest's dp: one missing key is reported."""
    dp = model.experts.dp if model.experts is not None else 1
    if dp == 1:
        return {}
    found = [k for k in model.ranks if k.count("-") == 2]
    stages = {int(key.split("-")[0][2:]) for key in found}
    valid = {pp for pp, _ in _expected_ranks(manifest, model.role)}
    tp = manifest.topology.tp
    wanted = (
        (f"{_rank_key(pp, t)}-dp{d}", (pp, t, d))
        for pp in sorted(stages & valid)
        for t in range(tp)
        for d in range(dp)
    )
    return dict(islice(wanted, len(found) + 1))


def _file_problems(manifest: Manifest) -> list[str]:
    problems = []
    seen: dict[tuple[str, int, int, int | None], list[int]] = {}
    roles = {m.role for m in manifest.models}
    for i, entry in enumerate(manifest.files):
        field = f"files[{i}]"
        expected = shard_path(entry.role, entry.pp, entry.tp, entry.part, entry.dp)
        if entry.path != expected:
            problems.append(f"{field}.path is {shorten(repr(entry.path), 60)}, not {expected!r}")
        if entry.role not in roles:
            problems.append(f"{field} is a {entry.role} file but there is no {entry.role} model")
        packed = entry.codec != "none"
        if packed != (entry.stored_bytes is not None) or packed != (
            entry.stored_sha256 is not None
        ):
            problems.append(
                f"{field} has codec {entry.codec!r} but stored_bytes and stored_sha256 do not "
                "fit it (both set for a codec, both null for none)"
            )
        seen.setdefault((entry.role, entry.pp, entry.tp, entry.dp), []).append(entry.part)
    for model in sorted(manifest.models, key=lambda m: m.role):
        role = model.role
        ranks: list[tuple[int, int, int | None]] = [
            (pp, tp, None) for pp, tp in _expected_ranks(manifest, role)
        ]
        ranks += [key for name, key in _dp_keys(manifest, model).items() if name in model.ranks]
        for pp, tp, dp in ranks:
            rank = f"stage {pp} tp rank {tp}" + (f" dp rank {dp}" if dp is not None else "")
            parts = sorted(seen.pop((role, pp, tp, dp), []))
            if not parts:
                problems.append(f"{rank} has no {role} file")
            elif parts != list(range(len(parts))):
                problems.append(
                    f"the {role} files of {rank} are parts {parts[:8]}, not 0, 1, ... each once"
                )
    for role, pp, tp, dp in sorted(seen, key=str):
        rank = f"stage {pp} tp rank {tp}" + (f" dp rank {dp}" if dp is not None else "")
        problems.append(f"files name {role} {rank}, outside the topology")
    return problems


def _extra_problems(manifest: Manifest) -> list[str]:
    problems = []
    has_draft = manifest.model("draft") is not None
    paths = [e.path for e in manifest.extra_files]
    if len(set(paths)) != len(paths):
        problems.append("extra_files names a path twice")
    for i, path in enumerate(paths):
        if not is_extra_file_path(path, has_draft):
            problems.append(
                f"extra_files[{i}].path is {shorten(repr(path), 60)}, not a config or "
                f"tokenizer file of the model folder{' or draft/' if has_draft else ''}"
            )
    return problems


def shard_path(role: str, pp: int, tp: int, part: int, dp: int | None = None) -> str:
    """The one path a rank file (or a dp rank's expert file) may have."""
    prefix = SHARDS_DIR if role == "target" else f"{DRAFT_DIR}/{SHARDS_DIR}"
    pattern = SHARD_PATTERN if dp is None else DP_SHARD_PATTERN
    return f"{prefix}/{pattern.format(pp=pp, tp=tp, dp=dp, part=part)}"


def is_extra_file_path(path: str, has_draft: bool) -> bool:
    """`NAME` or `draft/NAME`, where NAME is one of the files convert copies from a model
    folder (config, tokenizer, ...): never a hidden name, a shard or the manifest."""
    folder, _, name = path.rpartition("/")
    side = DRAFT_SIDE_FILES if folder == DRAFT_DIR else ()
    return (
        folder in (("", DRAFT_DIR) if has_draft else ("",))
        and (name in side or any(fnmatchcase(name, pattern) for pattern in COPIED_FILE_PATTERNS))
        and not name.startswith(".")
        and name != MANIFEST_NAME
        and not name.endswith((".safetensors", ".incomplete", ".tmp"))
        and not any(ch == "\\" or ord(ch) < 0x20 for ch in name)
    )


def _expected_ranks(manifest: Manifest, role: str) -> list[tuple[int, int]]:
    """(stage, tp rank) pairs that hold files of `role`: the draft lives on the last stage."""
    topo = manifest.topology
    stages = [s for s in manifest.stages if role == "target" or s == topo.pp - 1]
    return [(pp, tp) for pp in stages for tp in range(topo.tp)]


def _rank_key(pp: int, tp: int) -> str:
    return f"pp{pp}-tp{tp}"
