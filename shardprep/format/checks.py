"""The manifest's rules, checked on every read, before anything trusts a field.

`check_document` is docs/manifest.schema.json written as code (the schema is a test-time
tool, not a runtime dependency): types, ranges, required and unknown keys, naming the
field that is wrong. `check_consistency` adds what a schema cannot say: the topology adds
up, every (stage, tp rank) has its files and parameters, and every path is the one the
format gives that file, so a manifest cannot name the cache's own state or anything else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fnmatch import fnmatchcase
from itertools import islice
from typing import Any

from shardprep.constants import (
    COPIED_FILE_PATTERNS,
    DP_SHARD_PATTERN,
    DRAFT_DIR,
    DRAFT_SIDE_FILES,
    FORMAT,
    MANIFEST_NAME,
    SHARD_PATTERN,
    SHARDS_DIR,
)
from shardprep.errors import ManifestError
from shardprep.format.dtypes import DTYPE_SIZES
from shardprep.format.jsonio import shorten
from shardprep.format.records import Manifest, ModelEntry
from shardprep.format.vllm_layout import LEGACY_LAYOUT

# Far above any real model, far below what would make arithmetic or a range() costly.
MAX_COUNT = 2**48
MAX_RANKS = 1 << 16
DTYPES = tuple(DTYPE_SIZES)
ROLES = ("target", "draft")
RANK_KEY = re.compile(r"pp(0|[1-9][0-9]{0,4})-tp(0|[1-9][0-9]{0,4})(-dp(0|[1-9][0-9]{0,4}))?")
SHA256 = re.compile(r"[0-9a-f]{64}")
CODEC = re.compile(r"[a-z0-9_]{1,32}")


class _Bad(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message


Check = Callable[[Any, str], None]


def _fail(field: str, expected: str, value: Any) -> _Bad:
    return _Bad(field, f"{field} must be {expected}, found {shorten(repr(value), 40)}")


def _integer(minimum: int = 0, maximum: int = MAX_COUNT) -> Check:
    def check(value: Any, field: str) -> None:
        if type(value) is not int or not minimum <= value <= maximum:
            raise _fail(field, f"an integer from {minimum} to {maximum:,}", value)

    return check


def _string(pattern: re.Pattern[str] | None = None, what: str = "a string") -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
            raise _fail(field, what, value)

    return check


def _nullable(inner: Check) -> Check:
    def check(value: Any, field: str) -> None:
        if value is not None:
            inner(value, field)

    return check


def _enum(*choices: Any) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, (str, bool)) or value not in choices:
            raise _fail(field, "one of " + ", ".join(map(repr, choices)), value)

    return check


def _array(item: Check) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, list):
            raise _fail(field, "a list", value)
        for i, element in enumerate(value):
            item(element, f"{field}[{i}]")

    return check


def _pair(first: Check, second: Check) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, list) or len(value) != 2:
            raise _fail(field, "a pair [name, layer]", value)
        first(value[0], f"{field}[0]")
        second(value[1], f"{field}[1]")

    return check


def _map(key: Check, value_check: Check) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _fail(field, "an object", value)
        for name, element in value.items():
            key(name, f"{field} key {shorten(repr(name), 40)}")
            value_check(element, f"{field}[{shorten(repr(name), 60)}]")

    return check


def _object(name: str, fields: dict[str, Check], optional: frozenset[str] = frozenset()) -> Check:
    """An object with exactly `fields`; those in `optional` may be absent (newer keys that
    older manifests lack)."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _fail(field, f"an object ({name})", value)
        unknown = sorted(set(value) - set(fields))
        if unknown:
            shown = [shorten(k, 40) for k in unknown[:3]]
            raise _Bad(field, f"unknown key(s) {shown} in {name} ({FORMAT}) at {field}")
        missing = [k for k in fields if k not in value and k not in optional]
        if missing:
            raise _Bad(field, f"{field} ({name}) lacks the key(s) {missing}")
        for key, inner in fields.items():
            if key in value:
                inner(value[key], f"{field}.{key}")

    return check


_COUNT = _integer()
_SHA = _string(SHA256, "64 lowercase hex digits (a sha256)")
_DTYPE = _enum(*DTYPES)
_PARAM = _object("ParamSpec", {"dtype": _DTYPE, "shape": _array(_COUNT)})
_SOURCE = _object(
    "Source",
    {
        "model": _string(),
        "repo_id": _nullable(_string()),
        "revision": _nullable(_string()),
        "files": _array(
            _object("SourceFile", {"path": _string(), "bytes": _COUNT, "sha256": _nullable(_SHA)})
        ),
    },
)
_PLACEMENT = _enum("linear", "round_robin")
_EXPERTS = _object(
    "Experts",
    {
        "num_experts": _integer(1),
        "expert_parallel": _enum(True, False),
        "dp": _integer(1, MAX_RANKS),
        "placement": _PLACEMENT,
        "requested_placement": _PLACEMENT,
        "rank_experts": _array(_array(_COUNT)),
        "assumptions": _map(_string(), _string()),
    },
)
_MODEL = _object(
    "ModelEntry",
    {
        "role": _enum(*ROLES),
        "architecture": _string(),
        "dtype": _DTYPE,
        "folder": _string(),
        "num_layers": _COUNT,
        "source": _SOURCE,
        "method": _nullable(_string()),
        "ranks": _map(_string(RANK_KEY, "a rank key like pp0-tp1"), _map(_string(), _PARAM)),
        "spec_decode_only": _array(_pair(_string(), _COUNT)),
        "shared_with_target": _array(_string()),
        "experts": _nullable(_EXPERTS),
        "quantization": _nullable(_string()),
    },
    optional=frozenset({"quantization"}),
)
_FILE = _object(
    "FileEntry",
    {
        "path": _string(),
        "role": _enum(*ROLES),
        "pp": _integer(0, MAX_RANKS),
        "tp": _integer(0, MAX_RANKS),
        "part": _integer(0, MAX_RANKS),
        "bytes": _COUNT,
        "sha256": _SHA,
        "codec": _string(CODEC, "a codec name such as none or zstd"),
        "stored_bytes": _nullable(_COUNT),
        "stored_sha256": _nullable(_SHA),
        "dp": _nullable(_integer(0, MAX_RANKS)),
    },
    optional=frozenset({"dp"}),
)
_BOOL = _enum(True, False)
_NAME = _nullable(_string())
_REQUEST = _object(
    "ConversionRequest",
    {
        "tp": _integer(1, MAX_RANKS),
        "pp": _integer(1, MAX_RANKS),
        "draft": _NAME,
        "draft_method": _NAME,
        "partition": _NAME,
        "stage": _nullable(_integer(0, MAX_RANKS)),
        "max_part_bytes": _integer(1),
        "dtype": _string(),
        "revision": _NAME,
        "expert_parallel": _BOOL,
        "expert_placement": _PLACEMENT,
        "dp": _integer(1, MAX_RANKS),
        "mtp_draft": _BOOL,
    },
)
_LAYOUT = _object(
    "VllmLayout",
    {
        "id": _string(),
        "revisions": _map(_string(), _integer(1)),
        "verified_with": _array(_string()),
        "assumptions": _map(_string(), _string()),
    },
)


def _layout(value: Any, field: str) -> None:
    """The layout record, or the bare string artifacts recorded before it had structure."""
    if isinstance(value, str):
        _enum(LEGACY_LAYOUT)(value, field)
    else:
        _LAYOUT(value, field)


_MANIFEST = _object(
    "Manifest",
    {
        "format": _enum(FORMAT),
        "shardprep_version": _string(),
        "vllm_layout": _layout,
        "topology": _object(
            "Topology",
            {
                "tp": _integer(1, MAX_RANKS),
                "pp": _integer(1, MAX_RANKS),
                "partition": _array(_integer(1)),
                "expert_parallel": _enum(True, False),
            },
        ),
        "stages": _array(_integer(0, MAX_RANKS)),
        "models": _array(_MODEL),
        "files": _array(_FILE),
        "extra_files": _array(
            _object("ExtraFile", {"path": _string(), "bytes": _COUNT, "sha256": _SHA})
        ),
        "request": _nullable(_REQUEST),
        "plan_fingerprint": _nullable(_SHA),
    },
    optional=frozenset({"request", "plan_fingerprint"}),
)


def check_document(data: Any, where: str) -> None:
    """The parsed JSON has the manifest's shape, every field its type and range."""
    try:
        _MANIFEST(data, "manifest")
    except _Bad as bad:
        raise ManifestError(f"{where}: {bad.message}; {_ADVICE}") from None


_ADVICE = "the manifest is damaged or was not written by this shardprep: convert or fetch again"


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
        raise ManifestError(f"{where}: {'; '.join(problems[:3])}; {_ADVICE}")
    problems += _model_problems(manifest)
    problems += _file_problems(manifest)
    problems += _extra_problems(manifest)
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ManifestError(f"{where}: {'; '.join(problems[:3])}{more}; {_ADVICE}")


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
        ranks = [(pp, tp, None) for pp, tp in _expected_ranks(manifest, role)]
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
