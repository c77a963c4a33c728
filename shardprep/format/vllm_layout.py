"""The layout contract with vLLM: which parameter layout each vLLM release builds.

A rank file holds vLLM's parameters as `load_weights` leaves them. Shapes alone do not
pin that down (gate/up order, MLA head order, a padding rule), so each family and each
quantization scheme has a layout revision, and `RANGES` says which revision every vLLM
release range builds. The manifest records the revisions an artifact uses and the vLLM
releases they were verified with; the loader compares them with the running vLLM before
it opens a file. When the layout canary passes on a new vLLM, add it to `VERIFIED`;
when it fails, add a range with the family's revision bumped and what changed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardprep.constants import ENV_ALLOW_UNVERIFIED_VLLM, unverified_vllm_allowed
from shardprep.errors import LayoutMismatchError

LAYOUT_ID = "shardprep-vllm"
# What `vllm_layout` was before it had structure: the vLLM 0.32 layouts, revision 1 each.
LEGACY_LAYOUT = "vllm-0.32/1"

# Layouts some vLLM backends build differently before processing. An artifact holds the
# layout named here; a loader that meets another refuses and names the setting.
MOE_ASSUMPTIONS = {
    "moe_intermediate_padding": "none",  # FlashInfer TRT-LLM / ROCm AITER MoE round it up
    "fused_shared_experts": "none",  # ROCm AITER can append shared experts as routed ones
}
ASSUMPTIONS = {
    **MOE_ASSUMPTIONS,
    "expert_substitution": "none",  # every routed expert is stored, none is approximated
    "online_quantization": "none",  # stored as the checkpoint is; vLLM quantizes nothing
}


@dataclass(frozen=True)
class VllmRange:
    """vLLM releases from `first` on (until the next range's `first`) and the layout
    revision of each family and quantization scheme they build."""

    first: tuple[int, ...]
    revisions: Mapping[str, int]
    changes: Mapping[str, str] = field(default_factory=dict)  # name -> what changed here


RANGES: tuple[VllmRange, ...] = (
    VllmRange(
        (0, 32, 0),
        {
            "llama": 1, "qwen3_moe": 1, "mixtral": 1, "deepseek": 1,
            "glm4_moe": 1, "deepseek_v32": 1, "deepseek_v4": 1,
            "gpt_oss": 1, "kimi_k25": 1, "kimi_k3": 1,
            "qwen3_next": 1, "qwen3_next_mtp": 1,
            "qwen3_5_moe": 1, "qwen3_5_moe_mtp": 1,
            "eagle": 1, "eagle3": 1, "dflash": 1, "dspark": 1, "deepseek_mtp": 1,
            "glm4_moe_mtp": 1, "deepseek_v32_mtp": 1, "deepseek_v4_dspark": 1,
            "kimi_k3_dspark": 1, "kimi_k3_mtp": 1,
            "fp8_block": 1, "fp8_tensor": 1, "fp8_ct": 1, "int4_pack": 1,
            "mxfp4": 1, "mxfp4_pack": 1, "nvfp4_pack": 1, "modelopt_fp4": 1,
            "fp8_e8m0_mxfp4": 1,
            "derived": 1,
        },
    ),
)  # fmt: skip
# vLLM releases the layout canary (the byte-for-byte tests in tests/vllm/) passed on.
VERIFIED: tuple[tuple[int, ...], ...] = ((0, 32, 0),)


@dataclass(frozen=True)
class VllmLayout:
    """What the manifest records of the layout an artifact follows."""

    id: str
    revisions: dict[str, int]  # the artifact's families and schemes -> layout revision
    verified_with: tuple[str, ...]  # vLLM releases those revisions were verified on
    assumptions: dict[str, str] = field(default_factory=lambda: dict(ASSUMPTIONS))


def current_layout(names: set[str]) -> VllmLayout:
    """The layout this shardprep writes for the families and schemes `names`."""
    newest = RANGES[-1]
    verified = tuple(_text(v) for v in VERIFIED if v >= newest.first)
    return VllmLayout(LAYOUT_ID, {n: newest.revisions[n] for n in sorted(names)}, verified)


def derived_layout(layout: VllmLayout, derived_from: str) -> VllmLayout:
    """`layout` for an artifact whose layout was derived from vLLM `derived_from` itself
    (plan/derived): verified with that release only, so the loader refuses a newer vLLM
    unless told otherwise."""
    return VllmLayout(
        layout.id, layout.revisions, (_text(release(derived_from)),), layout.assumptions
    )


def legacy_layout() -> VllmLayout:
    """The record an artifact that names `LEGACY_LAYOUT` stands for: valid on vLLM 0.32."""
    return VllmLayout(LEGACY_LAYOUT, {}, ("0.32.0",))


def release(version: str) -> tuple[int, ...]:
    """Release numbers only: '0.32.0+cpu' and '0.32.0.dev3+g1234' are both (0, 32, 0)."""
    found = _release(version)
    if found is None:
        raise LayoutMismatchError(
            f"cannot read a release number from vLLM's version {version!r}; "
            f"set {ENV_ALLOW_UNVERIFIED_VLLM}=1 to load anyway"
        )
    return found


def _release(version: object) -> tuple[int, ...] | None:
    match = (
        re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
        if isinstance(version, str)
        else None
    )
    return tuple(int(part or 0) for part in match.groups()) if match else None


def _verified_with(layout: VllmLayout, where: str) -> list[tuple[int, ...]]:
    """The releases the manifest claims, each a release number (else the manifest is
    blamed, not the running vLLM)."""
    found = []
    for version in layout.verified_with:
        parsed = _release(version)
        if parsed is None:
            raise LayoutMismatchError(
                f"{where}'s manifest names {version!r} among the vLLM releases its layout was "
                "verified with, which is not a release number; convert it again with this "
                "shardprep"
            )
        found.append(parsed)
    return found


def check_layout(layout: VllmLayout, vllm_version: str, where: str) -> None:
    """Refuse an artifact whose layout the running vLLM does not build, or a vLLM newer
    than every release the layout was verified on, by the manifest's claim and by this
    shardprep's own table (unless ENV_ALLOW_UNVERIFIED_VLLM is set)."""
    running = release(vllm_version)
    verified = _verified_with(layout, where)
    served = f"vLLM {_span(verified)}" if verified else "the vLLM it was converted for"
    if layout.id == LEGACY_LAYOUT:
        if running[:2] != (0, 32):
            raise LayoutMismatchError(
                f"{where} was converted for vLLM 0.32's parameter layout ({LEGACY_LAYOUT}) but "
                f"vLLM {vllm_version} is running; serve it with vLLM 0.32.x, or convert it "
                "again with this shardprep"
            )
        return
    if layout.id != LAYOUT_ID:
        raise LayoutMismatchError(
            f"{where} follows the layout {layout.id!r}, which this shardprep does not know; "
            "install the shardprep that made it, or convert the model again"
        )
    in_range = _range_of(running)
    if in_range is None:
        raise LayoutMismatchError(
            f"vLLM {vllm_version} is older than every vLLM this shardprep knows "
            f"({_text(RANGES[0].first)} on); serve {where} with {served}"
        )
    for name, revision in sorted(layout.revisions.items()):
        builds = in_range.revisions.get(name)
        if builds != revision:
            change = in_range.changes.get(name) or f"this vLLM has no {name} layout we know"
            raise LayoutMismatchError(
                f"{where} holds the {name} layout revision {revision} but vLLM {vllm_version} "
                f"builds revision {builds} ({change}); serve it with {served}, or convert "
                "it again with a shardprep that knows this vLLM"
            )
    if unverified_vllm_allowed():
        return
    anyway = (
        f"set {ENV_ALLOW_UNVERIFIED_VLLM}=1 to load anyway (every parameter's shape and dtype "
        "is still checked)"
    )
    if not verified:
        raise LayoutMismatchError(
            f"{where}'s manifest names no vLLM release its layout was verified with; convert "
            f"it again with this shardprep, or {anyway}"
        )
    if running > max(verified):
        raise LayoutMismatchError(
            f"vLLM {vllm_version} is newer than every vLLM {where} was verified with "
            f"({', '.join(layout.verified_with)}); serve it with {served}, or {anyway}"
        )
    if running > max(VERIFIED):  # the manifest may claim releases this shardprep never saw
        own = _span(list(VERIFIED))
        raise LayoutMismatchError(
            f"vLLM {vllm_version} is newer than every vLLM this shardprep was verified with "
            f"({own}); serve {where} with vLLM {own}, install a shardprep verified with vLLM "
            f"{vllm_version}, or {anyway}"
        )


def check_covered(
    layout: VllmLayout, role: str, family: str, schemes: frozenset[str] | None, where: str
) -> None:
    """Refuse a layout record without a revision for the `role` model's `family`, or (a
    quantized model: `schemes`, those of its quantization method) for any of its schemes:
    nothing would tell whether the running vLLM builds that layout."""
    if layout.id == LEGACY_LAYOUT:  # it stands for the vLLM 0.32 layouts of every name
        return
    missing = [] if family in layout.revisions else [family]
    if schemes is not None and not schemes & set(layout.revisions):
        missing.append(" or ".join(sorted(schemes)) or "its quantization")
    if missing:
        raise LayoutMismatchError(
            f"{where}'s manifest records no layout revision for {' nor '.join(missing)} (its "
            f"{role} model), so no vLLM can be checked against it; convert it again with this "
            "shardprep"
        )


def expert_substitution(config: Mapping[str, Any]) -> str:
    """The config key by which vLLM would replace routed experts with others, or ''. An
    artifact stores every expert whole; a copy-into-parameter loader cannot serve that."""
    if config.get("approximate_experts"):
        return "approximate_experts"
    compression = config.get("compression_config")
    transform = compression.get("transform_config") if isinstance(compression, Mapping) else None
    if isinstance(transform, Mapping) and transform.get("expert_substitution"):
        return "compression_config.transform_config.expert_substitution"
    return ""


def _range_of(running: tuple[int, ...]) -> VllmRange | None:
    found = [r for r in RANGES if r.first <= running]
    return found[-1] if found else None


def _span(versions: list[tuple[int, ...]]) -> str:
    low, high = min(versions), max(versions)
    return _text(low) if low == high else f"{_text(low)} to {_text(high)}"


def _text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
