"""Architecture families: where each tensor of a checkpoint goes in vLLM.

Each module registers the Hugging Face architecture names (or draft methods) it knows.
Nothing outside this package mentions a tensor name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardprep.errors import ConfigError, summarize
from shardprep.plan.layout import Piece
from shardprep.plan.topology import Topology

Config = Mapping[str, Any]
Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Param:
    """One vLLM parameter: its name, the source pieces it is made of, the stages it is on."""

    name: str
    pieces: tuple[Piece, ...]
    stages: tuple[int, ...]
    dtype: str | None = None  # a fixed dtype (fp8 weights, float32 scales); None: the model's


@dataclass(frozen=True)
class Layout:
    """Everything a family says about one model for one topology."""

    params: tuple[Param, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)  # source name -> reason
    # (parameter, stage) pairs that vLLM builds only when a speculative draft runs.
    spec_decode_only: frozenset[tuple[str, int]] = frozenset()
    # Parameters a draft may share with the target instead of holding its own.
    shared_with_target: frozenset[str] = frozenset()
    # Source tensors that config.json implies but a checkpoint may leave out.
    optional_sources: frozenset[str] = frozenset()
    # Routed experts per MoE layer (0 for a dense model): sizes the expert stacks.
    num_experts: int = 0
    # Expert groups of grouped routing (config's n_group), which round_robin needs.
    num_expert_group: int | None = None


class Family(Protocol):
    name: str

    def expected_shapes(self, config: Config, **context: Any) -> dict[str, tuple[int, ...]]:
        """Every source tensor the config implies, with its shape (Hugging Face names)."""
        ...

    def check(self, config: Config, tp: int, **context: Any) -> list[str]:
        """Problems that make the model unsplittable at this tp, each a full sentence."""
        ...

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, **context: Any
    ) -> Layout: ...


def config_int(config: Config, key: str, default: int | None = None) -> int:
    """A size from config.json: a whole number >= 1, else one line naming the key."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ConfigError(f"config.json has no {key}; it is not a complete model config")
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        raise ConfigError(
            f"config.json has {key}: {value!r}, which is not a whole number of at least 1; "
            "fix config.json"
        )
    return int(value)


_TARGETS: dict[str, Family] = {}
_DRAFTS: dict[str, Family] = {}


def register_arch(*names: str) -> Callable[[type], type]:
    """Register a family for Hugging Face `architectures` names. Idempotent."""

    def wrap(cls: type) -> type:
        for name in names:
            _TARGETS[name] = cls()
        return cls

    return wrap


def register_draft(*methods: str) -> Callable[[type], type]:
    """Register a family for speculative-decoding draft methods (vLLM's `method`)."""

    def wrap(cls: type) -> type:
        for method in methods:
            _DRAFTS[method] = cls()
        return cls

    return wrap


def target_family(config: Config) -> tuple[str, Family]:
    _load_builtin()
    names = config.get("architectures") or []
    for name in names:
        if name in _TARGETS:
            return name, _TARGETS[name]
    raise ConfigError(
        f"architecture {summarize(names) or '(none in config.json)'} is not supported; "
        f"shardprep supports {summarize(sorted(_TARGETS), limit=20)}"
    )


def draft_family(method: str) -> Family:
    _load_builtin()
    if method not in _DRAFTS:
        raise ConfigError(
            f"draft method {method!r} is not supported; choose one of {', '.join(_standalone())}"
        )
    return _DRAFTS[method]


def _standalone() -> list[str]:
    """Draft methods of drafts that come as their own folder (`--draft`), not inside
    their target (MTP layers)."""
    return sorted(m for m, f in _DRAFTS.items() if getattr(f, "standalone", True))


def detect_draft_method(config: Config, names: list[str]) -> str:
    """The draft method its config and tensors imply; each draft family decides for
    itself, and exactly one must claim the draft."""
    _load_builtin()
    found = [m for m, f in sorted(_DRAFTS.items()) if f.recognizes(config, names)]  # type: ignore[attr-defined]
    if len(found) == 1:
        return found[0]
    why = "from its config and tensors" if not found else f"(it could be {' or '.join(found)})"
    raise ConfigError(
        f"cannot tell which kind of draft this is {why}; pass --draft-method "
        f"({', '.join(_standalone())})"
    )


def supported() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The registered target architectures and draft methods, sorted."""
    _load_builtin()
    return tuple(sorted(_TARGETS)), tuple(sorted(_DRAFTS))


def internal_draft_method(config: Config) -> str | None:
    """The draft method of the draft a target checkpoint carries inside itself (e.g.
    DeepSeek-V3's MTP layers), or None."""
    _, family = target_family(config)
    internal = getattr(family, "internal_draft", None)
    return internal(config) if internal else None


def draft_side_files() -> frozenset[str]:
    """Names of the side files (besides config and tokenizer) a draft folder may carry."""
    _load_builtin()
    return frozenset(name for f in _DRAFTS.values() for name in getattr(f, "side_files", ()))


def _load_builtin() -> None:
    from shardprep.plan.archs import (  # noqa: F401  (register themselves)
        deepseek,
        deepseek_mtp,
        dflash,
        llama,
        mixtral,
        qwen3_moe,
    )
