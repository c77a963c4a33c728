"""The regions file's shape (`shardprep.format.regions`), checked before anything is
unfolded: what `shardprep.format.schema` is to the manifest."""

from __future__ import annotations

from typing import Any

from shardprep.errors import ManifestError
from shardprep.format.jsonio import shorten
from shardprep.format.schema import (
    _COUNT,
    ADVICE,
    ROLES,
    _array,
    _Bad,
    _enum,
    _fail,
    _map,
    _object,
    _piece,
    _string,
    _two,
)

# The pieces a regions file may unfold to: four times a 1 TB model's.
MAX_REGION_PIECES = 1 << 21


def _range(value: Any, field: str, max_experts: int | None) -> int:
    """`{"experts": [first, stop], "each": [piece, ...]}`, each source naming `{e}`; the
    number of pieces it stands for."""
    _RANGE(value, field)
    first, stop = value["experts"]
    if not first < stop or (max_experts is not None and stop > max_experts):
        raise _fail(f"{field}.experts", _RANGE_TEXT.format(max_experts), value["experts"])
    for i, piece in enumerate(value["each"]):
        if "{e}" not in piece[0] or (len(piece) == 3 and "expert" in piece[2]):
            raise _Bad(field, f"{field}.each[{i}]: a piece of a range names {{e}}, not an expert")
    return (stop - first) * len(value["each"])


_RANGE = _object("ExpertRange", {"experts": _two, "each": _array(_piece)})
_RANGE_TEXT = "a range [first, stop) of experts, stop at most {} (the model's experts)"


def _expert_shape(value: Any, field: str, max_experts: int | None) -> int:
    if not isinstance(value, list) or len(value) != 4:
        raise _fail(field, "[pattern, first, stop, shape]", value)
    _string()(value[0], f"{field}[0]")
    _COUNT(value[1], f"{field}[1]")
    _COUNT(value[2], f"{field}[2]")
    _array(_COUNT)(value[3], f"{field}[3]")
    if "{e}" not in value[0] or not value[1] < value[2]:
        raise _fail(field, "a pattern naming {e} and a range [first, stop) of experts", value)
    if max_experts is not None and value[2] > max_experts:
        raise _fail(f"{field}[2]", _RANGE_TEXT.format(max_experts), value[2])
    return value[2] - value[1]


def _later(value: Any, field: str) -> None:
    """Checked by `check_regions` item by item, counting what each unfolds to."""


_REGIONS_MODEL = _object(
    "RegionsModel",
    {
        "role": _enum(*ROLES),
        "pieces": _map(_string(), _array(_later)),
        "source_shapes": _map(_string(), _array(_COUNT)),
        "expert_shapes": _array(_later),
    },
)


def check_regions(data: Any, where: str, version: str, max_experts: int | None) -> None:
    """A regions file has its shape, its ranges name at most `max_experts` experts (the
    most any model of the manifest has; None: unchecked), and it unfolds to at most
    MAX_REGION_PIECES pieces and source shapes."""
    try:
        _object("Regions", {"format": _enum(version), "models": _array(_REGIONS_MODEL)})(
            data, "regions"
        )
        unfolded = 0
        for m, model in enumerate(data["models"]):
            for name, items in model["pieces"].items():
                for i, item in enumerate(items):
                    at = f"regions.models[{m}].pieces[{shorten(repr(name), 60)}][{i}]"
                    if isinstance(item, dict):
                        unfolded += _range(item, at, max_experts)
                    else:
                        unfolded += _one(item, at)
            for i, item in enumerate(model["expert_shapes"]):
                at = f"regions.models[{m}].expert_shapes[{i}]"
                unfolded += _expert_shape(item, at, max_experts)
            if unfolded > MAX_REGION_PIECES:
                raise _Bad("regions", f"regions unfold to over {MAX_REGION_PIECES:,} entries")
    except _Bad as bad:
        raise ManifestError(f"{where}: {bad.message}; {ADVICE}") from None


def _one(value: Any, field: str) -> int:
    _piece(value, field)
    return 1
