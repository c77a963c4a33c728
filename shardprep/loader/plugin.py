"""The vLLM plugin: load format `sharded-fast`.

vLLM loads `register` through the `vllm.general_plugins` entry point in every process.
In each worker, `ShardedFastLoader.load_weights` finds the role (target or draft) and
the artifact, checks the topology against the manifest, reads this rank's files with
`shardprep.loader.reader` (no collective of any kind), copies each tensor into the
parameter of the same name and checks that every parameter was filled exactly once with
its exact shape and dtype. vLLM then runs `process_weights_after_loading` as usual.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from shardprep.constants import DRAFT_DIR, MANIFEST_NAME
from shardprep.errors import ConfigError, ManifestError
from shardprep.format.manifest import Manifest, ModelEntry, read_manifest, read_regions
from shardprep.loader.checks import (
    RankPlace,
    check_dtype,
    check_layers,
    check_moe,
    check_topology,
    vllm_layers,
)
from shardprep.loader.contract import check_contract
from shardprep.loader.fill import Destinations, fill_parameters, stack_pads
from shardprep.loader.gds import GdsRequest
from shardprep.loader.reader import read_rank
from shardprep.loader.regroup import check_served, load_regrouped, running_split

if TYPE_CHECKING:
    from shardprep.plan.archs.base import DraftFamily, Family
    from shardprep.plan.topology import ExpertSplit

LOAD_FORMAT = "sharded-fast"
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")
logger = logging.getLogger("shardprep.loader")


def register() -> None:
    """Entry point of `vllm.general_plugins`: add the `sharded-fast` load format.
    Idempotent: vLLM calls it in every process, possibly more than once."""
    from vllm.model_executor import model_loader

    registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if registry.get(LOAD_FORMAT) is ShardedFastLoader:
        return
    _route_logs_through_vllm()
    model_loader.register_model_loader(LOAD_FORMAT)(ShardedFastLoader)


def _route_logs_through_vllm() -> None:
    """Show shardprep's log lines next to vLLM's, in its format, when vLLM has handlers."""
    ours, theirs = logging.getLogger("shardprep"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


@dataclass(frozen=True)
class LoaderOptions:
    """The keys `--model-loader-extra-config` accepts with `--load-format sharded-fast`."""

    verify: bool = False
    """Check each rank file's sha256 against the manifest before reading it."""
    gds: bool | None = None
    """Read with GPUDirect Storage (`gds.py`): true even when several workers load (each
    then opens every visible GPU), false never; by default only where one worker loads."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LoaderOptions:
        extra = dict(extra or {})
        allowed = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(allowed))
        if unknown:
            raise ConfigError(
                f"--model-loader-extra-config has unknown key(s) {unknown} for "
                f"--load-format {LOAD_FORMAT}; the allowed keys are {sorted(allowed)}"
            )
        for name, value in extra.items():
            if not isinstance(value, bool):
                raise ConfigError(
                    f"--model-loader-extra-config key {name!r} must be true or false "
                    f"for --load-format {LOAD_FORMAT}, found {value!r}"
                )
        return cls(**extra)


class ShardedFastLoader(BaseModelLoader):
    """Loads a shardprep artifact rank-locally. vLLM creates loaders several times per
    process, so `__init__` only checks the options."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = LoaderOptions.from_extra_config(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the artifact is a local folder (checked at load)."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        started = time.perf_counter()
        role = model_role(model_config)
        place = RankPlace.current()
        built, vllm_partition = (
            vllm_layers(model, model_config, place) if role == "target" else ((0, 0), None)
        )
        artifact = resolve_artifact(
            model_config, role, place, vllm_partition,
            experts=lambda entry: running_split(model, entry, place),
        )  # fmt: skip
        manifest = read_manifest(artifact)
        entry = model_entry(manifest, role, artifact)
        check_contract(artifact, manifest, entry, model, model_config)
        check_dtype(artifact, entry, model_config.dtype)
        if vllm_partition is None:  # a draft lives on the last stage, whatever the split
            vllm_partition = tuple(manifest.topology.partition)
        if (place.tp_size, place.pp_size, vllm_partition) != _own(manifest):
            check_served(artifact, manifest, place.tp_size, place.pp_size)
            manifest = read_regions(artifact, manifest)
            entry = model_entry(manifest, role, artifact)
            load_regrouped(
                artifact, manifest, entry, model, place, vllm_partition,
                verify=self.options.verify,
                family=draft_family(manifest, entry),
                may_lack=_may_lack(manifest, entry, model),
                padded=padded_at_load(manifest, entry),
                stacks=stack_pads(entry.quantization),
            )  # fmt: skip
            logger.info("shardprep loaded %s in %.2f s", artifact, time.perf_counter() - started)
            return
        check_topology(artifact, manifest, place)
        if role == "target":
            check_layers(artifact, manifest, place, built, vllm_partition)
        check_moe(artifact, manifest, entry, model, place)
        family = draft_family(manifest, entry) or target_family(entry)
        if family is not None:  # it may drop parts (DSpark's absent confidence head): first
            family.before_fill(
                model, set(entry.rank_params(place.pp_rank, place.tp_rank, place.dp_rank))
            )
        into = Destinations(model)
        tensors = read_rank(
            artifact, role, place.pp_rank, place.tp_rank, manifest=manifest,
            device=_device_of(model), verify=self.options.verify, into=into,
            dp_rank=place.dp_rank, gds=GdsRequest(self.options.gds, place.processes),
        )  # fmt: skip
        where = f"{artifact} ({role}, rank pp{place.pp_rank} tp{place.tp_rank})"
        filled = fill_parameters(
            model, tensors, ignorable=_ignorable(entry, place),
            may_lack=_may_lack(manifest, entry, model), where=where,
            layout=manifest.vllm_layout.id, padded=padded_at_load(manifest, entry),
            stacks=stack_pads(entry.quantization), into=into,
        )  # fmt: skip
        if family is not None:
            family.after_fill(model, set(filled))
        logger.info(
            "shardprep loaded %d tensors of %s in %.2f s",
            len(filled), where, time.perf_counter() - started,
        )  # fmt: skip


def _own(manifest: Manifest) -> tuple[int, int, tuple[int, ...]]:
    topo = manifest.topology
    return topo.tp, topo.pp, tuple(topo.partition)


def model_role(model_config: ModelConfig) -> str:
    """'target' or 'draft'. During a load, vLLM's current config is the worker's: the
    target is loaded with its `model_config`, a draft with the speculative config's
    `draft_model_config` (a distinct object even when the paths are equal). Without a
    current config, the folder layout decides."""
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None:
        spec = current.speculative_config
        if spec is not None and model_config is spec.draft_model_config:
            return "draft"
        if model_config is current.model_config:
            return "target"
    path = model_path(model_config)
    if (path / MANIFEST_NAME).is_file():
        return "target"
    if (path.parent / MANIFEST_NAME).is_file():
        return "draft"
    raise _not_an_artifact(path)


def model_path(model_config: ModelConfig) -> Path:
    return Path(getattr(model_config, "model_weights", "") or model_config.model)


def resolve_artifact(
    model_config: ModelConfig,
    role: str,
    place: RankPlace,
    partition: tuple[int, ...] | None,
    experts: Callable[[ModelEntry], tuple[ExpertSplit, int] | None] | None = None,
) -> Path:
    """The local artifact: the model path itself, or, for a Hub repo id, the parts this
    worker reads (the artifact's stages and tp ranks that make its rank of vLLM's
    `partition`, None for a draft, and those that hold the experts it takes by
    `experts`, vLLM's split of a model's experts on this worker) fetched into the
    stage-sharded cache (once per node, under a lock)."""
    path = model_path(model_config)
    # A draft has a repo id for a path when it lives in its target (MTP layers).
    if not path.exists() and REPO_ID.fullmatch(str(path)):
        from shardprep.hub.cache import ensure_rank

        return ensure_rank(
            str(path), role, stage=place.pp_rank, tp=place.tp_size, tp_rank=place.tp_rank,
            partition=partition, experts=experts, revision=model_config.revision,
        )  # fmt: skip
    return find_artifact(path, role)


def find_artifact(path: Path, role: str) -> Path:
    """A target's model path is the artifact; a draft's is `ARTIFACT/draft` (or the
    artifact itself, for drafts that share the target's folder)."""
    if (path / MANIFEST_NAME).is_file():
        return path
    if role == "draft" and (path.parent / MANIFEST_NAME).is_file():
        return path.parent
    raise _not_an_artifact(path, role)


def _not_an_artifact(path: Path, role: str = "target") -> ManifestError:
    if not path.is_dir():
        return ManifestError(
            f"--load-format {LOAD_FORMAT} reads a shardprep artifact, but {path} is neither a "
            "local folder nor a Hugging Face repo id; pass the artifact folder or its repo id"
        )
    where = f"{path} or its parent" if role == "draft" else str(path)
    return ManifestError(
        f"{where} has no {MANIFEST_NAME}, so it is not a complete shardprep artifact; "
        f"create one with `shardprep convert MODEL -o OUT --tp T --pp P` and start vLLM on "
        f"OUT (the draft on OUT/{DRAFT_DIR}), or use --load-format auto for a plain checkpoint"
    )


def model_entry(manifest: Manifest, role: str, artifact: Path) -> ModelEntry:
    entry = manifest.model(role)
    if entry is None:
        raise ManifestError(
            f"{artifact} has no {role} model; convert the target with its draft "
            f"(`shardprep convert MODEL --draft DRAFT -o OUT`) to serve the draft from it"
        )
    return entry


def _ignorable(entry: ModelEntry, place: RankPlace) -> set[str]:
    """File tensors vLLM builds only when an EAGLE draft runs with pp > 1."""
    return {name for name, stage in entry.spec_decode_only if stage == place.pp_rank}


def _may_lack(manifest: Manifest, entry: ModelEntry, model: nn.Module) -> set[str]:
    """Parameters vLLM itself never loads from these files: a draft's that vLLM shares
    with the target or leaves at their initial value (the draft family says which), and
    the KV-cache scales a quantized model gets but whose checkpoint has none."""
    lacking = set()
    if entry.quantization:
        from shardprep.plan.quant import never_loaded  # pure data, only a quantized model

        lacking = {name for name, _ in model.named_parameters() if never_loaded(name)}
    if entry.role != "draft":
        return lacking
    family = draft_family(manifest, entry)
    unloaded = family.may_stay_unloaded if family is not None else frozenset()
    return lacking | set(entry.shared_with_target) | set(unloaded)


def draft_family(manifest: Manifest, entry: ModelEntry) -> DraftFamily | None:
    """The draft's family, whose hooks redo what vLLM's own `load_weights` does besides
    copying (e.g. EAGLE's `has_own_*` flags, DFlash's fused KV buffers); None for a target."""
    target = manifest.model("target")
    if entry.role != "draft" or not entry.method or target is None:
        return None
    from shardprep.plan import archs  # pure data, but only a draft needs it

    return archs.draft_family(entry.method, archs.target_family_of(target.architecture).name)


def target_family(entry: ModelEntry) -> Family | None:
    """The target's family, for the hooks that redo what vLLM's `load_weights` does besides
    copying (Kimi-K3's copies of the KDA conv and norm weights for its decode kernels)."""
    if entry.role != "target":
        return None
    from shardprep.plan import archs  # pure data

    return archs.target_family_of(entry.architecture)


def padded_at_load(manifest: Manifest, entry: ModelEntry) -> Callable[[str], bool]:
    """Which parameters vLLM may build padded along dim 0 on this device, filling only the
    front (`Family.padded_at_load`: DeepSeek-V4's `attn_sink` on NVIDIA GPUs)."""
    from shardprep.plan import archs  # pure data

    if entry.role == "draft":
        family = draft_family(manifest, entry)
        return family.padded_at_load if family is not None else _never
    try:
        return archs.target_family_of(entry.architecture).padded_at_load
    except ConfigError:  # a family this shardprep does not know: nothing is padded
        return _never


def _never(name: str) -> bool:
    return False


def _device_of(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.device) if param is not None else "cpu"
