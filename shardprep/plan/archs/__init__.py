"""The family plug-ins and their registry: where each tensor of a checkpoint goes in vLLM.

One module per family or draft; this table names them, in the style of vLLM's model
registry, and a module is imported only when a model of it is planned. Targets are keyed
by Hugging Face architecture name, drafts by (draft method, target family), "*" standing
for any target. Nothing outside this package mentions a tensor name.
"""

from __future__ import annotations

import importlib
from functools import cache

from shardprep.errors import ConfigError, summarize
from shardprep.plan.archs.base import Config, DraftFamily, Family

ANY_TARGET = "*"

# architecture -> (module, class); a module that starts with "." is this package's: a
# family's own (`.llama`) or one of a family folder (`.kimi_k3.family`)
_TARGETS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": (".llama", "LlamaFamily"),
    "MistralForCausalLM": (".llama", "LlamaFamily"),
    "Qwen2ForCausalLM": (".llama", "LlamaFamily"),
    "Qwen3ForCausalLM": (".llama", "LlamaFamily"),
    "Qwen3MoeForCausalLM": (".qwen3_moe", "Qwen3MoeFamily"),
    "MixtralForCausalLM": (".mixtral", "MixtralFamily"),
    "DeepseekV2ForCausalLM": (".deepseek.v3", "DeepseekFamily"),
    "DeepseekV3ForCausalLM": (".deepseek.v3", "DeepseekFamily"),
    "DeepseekV32ForCausalLM": (".deepseek.v32", "DeepseekV32Family"),
    "DeepseekV4ForCausalLM": (".deepseek_v4.family", "DeepseekV4Family"),
    "Glm4MoeForCausalLM": (".glm4_moe", "Glm4MoeFamily"),
    "GptOssForCausalLM": (".gpt_oss", "GptOssFamily"),
    "KimiK25ForConditionalGeneration": (".deepseek.kimi_k25", "KimiK25Family"),
    "KimiK3ForConditionalGeneration": (".kimi_k3.family", "KimiK3Family"),
    "Qwen3NextForCausalLM": (".qwen3_next.family", "Qwen3NextFamily"),
    "Qwen3_5MoeForConditionalGeneration": (".qwen3_next.qwen3_5_moe", "Qwen35MoeFamily"),
}
# (vLLM's speculative `method`, target family name or ANY_TARGET) -> (module, class)
_DRAFTS: dict[tuple[str, str], tuple[str, str]] = {
    ("eagle", ANY_TARGET): (".llama", "EagleDraft"),
    ("eagle3", ANY_TARGET): (".llama", "Eagle3Draft"),
    ("dflash", ANY_TARGET): (".dflash", "DFlashDraft"),
    ("dspark", ANY_TARGET): (".dflash", "DSparkDraft"),
    ("dspark", "deepseek_v4"): (".deepseek_v4.dspark", "DeepseekV4DSparkDraft"),
    ("dspark", "kimi_k3"): (".kimi_k3.dspark", "KimiK3DSparkDraft"),
    ("mtp", "deepseek"): (".deepseek.mtp", "DeepseekMtpDraft"),
    ("mtp", "deepseek_v32"): (".deepseek.v32", "DeepseekV32MtpDraft"),
    ("mtp", "glm4_moe"): (".glm4_moe", "Glm4MoeMtpDraft"),
    ("mtp", "kimi_k3"): (".kimi_k3.mtp", "KimiK3MtpDraft"),
    ("mtp", "qwen3_next"): (".qwen3_next.mtp", "Qwen3NextMtpDraft"),
    ("mtp", "qwen3_5_moe"): (".qwen3_next.qwen3_5_moe", "Qwen35MoeMtpDraft"),
    # the drafts of a target whose layout is derived from vLLM (plan/derived)
    ("mtp", "derived"): ("shardprep.plan.derived", "DerivedMtpDraft"),
    ("eagle", "derived"): ("shardprep.plan.derived.standalone", "DerivedEagleDraft"),
    ("eagle3", "derived"): ("shardprep.plan.derived.standalone", "DerivedEagle3Draft"),
    ("dflash", "derived"): ("shardprep.plan.derived.standalone", "DerivedDFlashDraft"),
    ("dspark", "derived"): ("shardprep.plan.derived.standalone", "DerivedDSparkDraft"),
}


def register_target(architecture: str, module: str, cls: str) -> None:
    """Add a target family (`module`: a full import path, or one that starts with "."
    under this package).
    Registering the same entry again does nothing; another entry for the name is an error."""
    _register(_TARGETS, architecture, (module, cls), f"architecture {architecture!r}")


def register_draft(method: str, target: str, module: str, cls: str) -> None:
    """Add a draft family for `method` drafting a `target` family (or ANY_TARGET)."""
    _register(_DRAFTS, (method, target), (module, cls), f"draft {method!r} for {target!r}")


def _register(table: dict, key: object, entry: tuple[str, str], what: str) -> None:
    if table.get(key, entry) != entry:
        raise ConfigError(f"{what} is registered twice: as {table[key]} and as {entry}")
    table[key] = entry


@cache
def _instance(module: str, cls: str) -> Family:
    return getattr(importlib.import_module(module, package=__name__), cls)()


def target_family(config: Config) -> tuple[str, Family]:
    """The family of the first architecture named; one no family names gets the layout
    derived from vLLM's own model definition (plan/derived), when vLLM is installed."""
    names = config.get("architectures") or []
    for name in names:
        if name in _TARGETS:
            return name, _instance(*_TARGETS[name])
    if names and isinstance(names, list) and isinstance(names[0], str):
        from shardprep.plan import derived

        if not derived.available():
            raise derived.unavailable(names[0], summarize(sorted(_TARGETS), limit=20))
        return names[0], derived.DerivedFamily()
    raise ConfigError(
        f"architecture {summarize(names) or '(none in config.json)'} is not supported; "
        f"shardprep supports {summarize(sorted(_TARGETS), limit=20)}"
    )


def read_config(config: Config) -> Config:
    """config.json as vLLM reads it for its target family (transformers' attribute
    maps); a config of no registered target (a draft's own) as it is."""
    names = config.get("architectures") or []
    for name in names if isinstance(names, list) else []:
        if isinstance(name, str) and name in _TARGETS:
            return _instance(*_TARGETS[name]).read_config(config)
    return config


def target_family_of(architecture: str) -> Family:
    return target_family({"architectures": [architecture]})[1]


def draft_family(method: str, target: str) -> DraftFamily:
    """The draft family of `method` for a target of family `target`."""
    entry = _DRAFTS.get((method, target)) or _DRAFTS.get((method, ANY_TARGET))
    if entry is None:
        raise ConfigError(
            f"draft method {method!r} is not supported for a {target} target; choose one "
            f"of {', '.join(standalone_methods())}"
        )
    family = _instance(*entry)
    assert isinstance(family, DraftFamily)
    return family


def _drafts_for(target: str) -> dict[str, DraftFamily]:
    methods = {method for method, _ in _DRAFTS}
    return {
        m: draft_family(m, target)
        for m in sorted(methods)
        if (m, target) in _DRAFTS or (m, ANY_TARGET) in _DRAFTS
    }


def standalone_methods() -> list[str]:
    """Methods of drafts that come as their own folder (`--draft`), not inside a target."""
    return sorted({method for method, target in _DRAFTS if draft_family(method, target).standalone})


def detect_draft_method(config: Config, names: list[str], target: str) -> str:
    """The draft method its config and tensors imply; each draft family decides for
    itself, and exactly one must claim the draft."""
    drafts = _drafts_for(target).items()
    found = [m for m, f in drafts if f.standalone and f.recognizes(config, names)]
    if len(found) == 1:
        return found[0]
    why = "from its config and tensors" if not found else f"(it could be {' or '.join(found)})"
    raise ConfigError(
        f"cannot tell which kind of draft this is {why}; pass --draft-method "
        f"({', '.join(standalone_methods())})"
    )


def supported() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The registered target architectures and draft methods, sorted."""
    return tuple(sorted(_TARGETS)), tuple(sorted({m for m, _ in _DRAFTS}))


def all_families() -> list[Family]:
    """One instance of every registered family and draft family."""
    return [_instance(*entry) for entry in sorted({*_TARGETS.values(), *_DRAFTS.values()})]


def internal_draft_method(config: Config) -> str | None:
    """The draft method of the draft a target checkpoint carries inside itself (e.g.
    DeepSeek-V3's MTP layers), or None."""
    _, family = target_family(config)
    return family.internal_draft(config)
