"""compressed-tensors' `ignore` list, matched as vLLM's `should_ignore_layer` matches it."""

from __future__ import annotations

import functools
import re

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
