"""The manifest's shape, checked on every read before anything trusts a field.

`check_document` is docs/manifest.schema.json written as code (the schema is a test-time
tool, not a runtime dependency): types, ranges, required and unknown keys, naming the
field that is wrong. What ties the fields together is `shardprep.format.checks`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from shardprep.constants import FORMAT, REGIONS_NAME
from shardprep.errors import ManifestError
from shardprep.format.cut_names import CUTS, MX_CUTS
from shardprep.format.dtypes import DTYPE_SIZES
from shardprep.format.jsonio import shorten
from shardprep.format.request import REVISION
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
_REVISION = _nullable(_string(REVISION, "a branch, tag or commit name"))
_DTYPE = _enum(*DTYPES)
_PARAM = _object("ParamSpec", {"dtype": _DTYPE, "shape": _array(_COUNT)})
_SOURCE = _object(
    "Source",
    {
        "model": _string(),
        "repo_id": _nullable(_string()),
        "revision": _REVISION,
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
_PAIR_OF_COUNTS = _array(_COUNT)


def _two(value: Any, field: str) -> None:
    _PAIR_OF_COUNTS(value, field)
    if len(value) != 2:
        raise _fail(field, "a pair of integers", value)


_CUT = _enum(*CUTS)
_SCALE = _object(
    "ScaleEntry",
    {
        "shape": _two,
        "cut": _enum("replicate", "rows", "cols", "kv_heads"),
        "block": _two,
        "grid": _nullable(_two),
        "heads": _integer(1),
    },
    optional=frozenset({"grid", "heads"}),
)
_PIECE_EXTRA = _object(
    "PieceEntry",
    {"heads": _integer(1), "expert": _COUNT, "scale_of": _SCALE, "q_heads": _integer(1)},
    optional=frozenset({"heads", "expert", "scale_of", "q_heads"}),
)


_WITH_HEADS = ("kv_heads", "parts_rows", "qkv_rows", "qkv_heads", "align_rows", "zero_rows")


def _piece(value: Any, field: str) -> None:
    """`[source, cut]` or `[source, cut, {heads, expert, scale_of}]`."""
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise _fail(field, "a piece [source, cut] or [source, cut, {...}]", value)
    _string()(value[0], f"{field}[0]")
    _CUT(value[1], f"{field}[1]")
    if len(value) == 3:
        _PIECE_EXTRA(value[2], f"{field}[2]")
    extra = value[2] if len(value) == 3 else {}
    if (value[1] in _WITH_HEADS) != ("heads" in extra):
        raise _Bad(
            field,
            f"{field}: a {', '.join(_WITH_HEADS[:-1])} or {_WITH_HEADS[-1]} piece, and only "
            "one, names its heads",
        )
    if (value[1] == "qkv_heads") != ("q_heads" in extra):
        raise _Bad(field, f"{field}: a qkv_heads piece, and only one, names its q_heads")
    if (value[1] in ("block_scale", "packed", *MX_CUTS)) != ("scale_of" in extra):
        raise _Bad(
            field,
            f"{field}: a block_scale, packed or mx piece, and only one, names what it holds",
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
        "pieces": _map(_string(), _array(_piece)),
        "source_shapes": _map(_string(), _array(_COUNT)),
    },
    optional=frozenset({"quantization", "pieces", "source_shapes"}),
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
        "revision": _REVISION,
        "expert_parallel": _BOOL,
        "expert_placement": _PLACEMENT,
        "dp": _integer(1, MAX_RANKS),
        "mtp_draft": _BOOL,
        "mxfp4_pad": _NAME,
    },
    optional=frozenset({"mxfp4_pad"}),
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
        "regions": _object(
            "RegionsFile",
            {
                "path": _enum(REGIONS_NAME),
                "bytes": _COUNT,
                "sha256": _SHA,
                "cuts": _array(_CUT),
                "roles": _array(_enum(*ROLES)),
                "mx": _array(_piece),
            },
            optional=frozenset({"mx"}),
        ),
    },
    optional=frozenset({"request", "plan_fingerprint", "regions"}),
)


def check_document(data: Any, where: str) -> None:
    """The parsed JSON has the manifest's shape, every field its type and range."""
    try:
        _MANIFEST(data, "manifest")
    except _Bad as bad:
        raise ManifestError(f"{where}: {bad.message}; {ADVICE}") from None


ADVICE = "the manifest is damaged or was not written by this shardprep: convert or fetch again"
