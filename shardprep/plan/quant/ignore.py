"""What every compressed-tensors scheme reads alike: the one config group of its
`quantization_config`, and the `ignore` list, matched as vLLM's `should_ignore_layer`
matches it."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

Config = Mapping[str, Any]

EXPERT_PART = re.compile(r"^\.(\d+)\.")


def ignored(patterns: tuple[str, ...], layer: str, *parts: str) -> bool:
    """Whether vLLM leaves a layer unquantized: its name, or the names of its parts, in
    the ignore list `patterns`. vLLM asks about a FusedMoE layer through its expert 0
    (`{layer}.0.gate_proj` ...), whichever expert `parts` name."""
    names = [layer]
    for part in parts:
        expert = EXPERT_PART.match(part.removeprefix(layer)) if part.startswith(layer) else None
        names.append(f"{layer}.0.{part[len(layer) + expert.end() :]}" if expert else part)
    return any(_ignored(name, patterns) for name in names)


@functools.lru_cache(maxsize=1 << 16)
def _ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether `name` is in the ignore list `patterns` (once per name: a checkpoint's
    experts all ask about their layer's expert 0)."""
    return any(_matches(name, pattern) for pattern in patterns)


def _matches(name: str, pattern: str) -> bool:
    """vLLM's `is_equal_or_regex_match`: `re:` patterns with `re.match`, others exact."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


def not_converted(names: frozenset[str], layer: str, *parts: str) -> bool:
    """Whether vLLM's `Fp8Config` leaves a layer unquantized (`is_layer_skipped`, exact
    mode): `layer` (vLLM's name of it) or one of its `parts` (a fused layer's checkpoint
    names) among `names`; an unfused layer whose name holds "experts" (a FusedMoE, a
    shared expert's projection) when any listed name that holds "experts" contains it,
    so that one expert's projection listed leaves the whole FusedMoE unquantized."""
    if layer in names or any(part in names for part in parts):
        return True
    fused = bool(parts) and not layer.endswith(".experts") and layer not in parts
    if "experts" not in layer or fused:
        return False
    return any(layer in name for name in names if "experts" in name)


def config_group(quant: Config, wanted: Config) -> tuple[Config, Config, str]:
    """The one config group of a compressed-tensors `quantization_config` and its weights,
    with what of them shardprep does not lay out ("" when nothing): several groups, none
    with weights, targets other than Linear, weights whose keys differ from `wanted`."""
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        return {}, {}, f"{len(groups) if isinstance(groups, Mapping) else 'no'} config groups"
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping):
        return {}, {}, "a config group without weights"
    if "Linear" not in (group.get("targets") or []):
        return group, weights, f"targets {group.get('targets')!r}"
    for key, value in wanted.items():
        if weights.get(key) != value:
            return group, weights, f"weights {key} {weights.get(key)!r}"
    return group, weights, ""


def ignore_list_refusal(quant: Config) -> str:
    """What is wrong with the `ignore` list, or "" (none is an empty one)."""
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(name, str) for name in ignore):
        return "an ignore list that is not a list of names"
    for pattern in (name[3:] for name in ignore if name.startswith("re:")):
        try:
            re.compile(pattern)
        except re.error as exc:
            return f"an ignore pattern 're:{pattern}' that is not a regular expression ({exc})"
    return ""
