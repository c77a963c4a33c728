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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from shardprep.constants import DRAFT_DIR, MANIFEST_NAME
from shardprep.errors import (
    ConfigError,
    ManifestError,
    TopologyMismatchError,
    WeightMismatchError,
    summarize,
)
from shardprep.loader.experts import RunningExperts, check_device_layout, check_experts
from shardprep.loader.reader import read_rank, torch_dtypes
from shardprep.manifest import Manifest, ModelEntry, read_manifest
from shardprep.safetensors_io import TensorInfo

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


@dataclass(frozen=True)
class RankPlace:
    """Where this worker sits: its ranks in vLLM's pipeline, tensor and data parallel
    groups (the dp rank picks its experts where they are stored per dp rank)."""

    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int = 0

    @classmethod
    def current(cls) -> RankPlace:
        from vllm.distributed import (
            get_dp_group,
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        pp, dp = get_pp_group(), get_dp_group()  # FusedMoE reads its dp rank the same way
        return cls(
            pp_rank=pp.rank_in_group,
            pp_size=pp.world_size,
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
            dp_rank=dp.rank_in_group if dp.world_size > 1 else 0,
        )


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
        artifact = resolve_artifact(model_config, role, place.pp_rank)
        manifest = read_manifest(artifact)
        entry = model_entry(manifest, role, artifact)
        check_dtype(artifact, entry, model_config.dtype)
        check_topology(artifact, manifest, place)
        if role == "target":
            check_layers(artifact, manifest, place, *vllm_layers(model, model_config, place))
        check_moe(artifact, manifest, entry, model, place)
        tensors = read_rank(
            artifact, role, place.pp_rank, place.tp_rank, manifest=manifest,
            device=_device_of(model), verify=self.options.verify, into=Destinations(model),
            dp_rank=place.dp_rank,
        )  # fmt: skip
        where = f"{artifact} ({role}, rank pp{place.pp_rank} tp{place.tp_rank})"
        family = draft_family(entry)
        if family is not None and hasattr(family, "before_fill"):
            family.before_fill(
                model, set(entry.rank_params(place.pp_rank, place.tp_rank, place.dp_rank))
            )
        filled = fill_parameters(
            model, tensors, ignorable=_ignorable(entry, place), may_lack=_may_lack(entry),
            where=where, layout=manifest.vllm_layout,
        )  # fmt: skip
        if role == "draft":
            mark_eagle_weights(model, filled)
        if family is not None and hasattr(family, "after_fill"):
            family.after_fill(model, set(filled))
        logger.info(
            "shardprep loaded %d tensors of %s in %.2f s",
            len(filled), where, time.perf_counter() - started,
        )  # fmt: skip


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


def resolve_artifact(model_config: ModelConfig, role: str, pp_rank: int) -> Path:
    """The local artifact: the model path itself, or, for a Hub repo id, this rank's stage
    fetched into the stage-sharded cache (once per node, under a lock)."""
    path = model_path(model_config)
    if role == "target" and not path.exists() and REPO_ID.fullmatch(str(path)):
        from shardprep.cache import ensure_stage

        return ensure_stage(str(path), pp_rank, revision=model_config.revision)
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


TORCH_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def check_dtype(artifact: Path, entry: ModelEntry, running: torch.dtype) -> None:
    """The weights' dtype is fixed at conversion; vLLM's must be the same."""
    stored = TORCH_DTYPE_NAMES.get(entry.dtype, entry.dtype)
    if str(running).removeprefix("torch.") == stored:
        return
    raise TopologyMismatchError(
        f"artifact {artifact} holds {stored} weights but vLLM runs {running}; start vLLM "
        f"with --dtype {stored}, or convert again with `shardprep convert --dtype "
        f"{str(running).removeprefix('torch.')}`"
    )


def check_topology(artifact: Path, manifest: Manifest, place: RankPlace) -> None:
    topo = manifest.topology
    if (topo.tp, topo.pp) == (place.tp_size, place.pp_size):
        return
    source = _source(manifest)
    raise TopologyMismatchError(
        f"artifact {artifact} is tp{topo.tp} x pp{topo.pp} but vLLM runs "
        f"tp{place.tp_size} x pp{place.pp_size}; re-run `shardprep convert {source} "
        f"--tp {place.tp_size} --pp {place.pp_size} -o NEW` or start vLLM with "
        f"--tensor-parallel-size {topo.tp} --pipeline-parallel-size {topo.pp}"
    )


def vllm_layers(
    model: nn.Module, model_config: ModelConfig, place: RankPlace
) -> tuple[tuple[int, int], tuple[int, ...]]:
    """The layer range vLLM built on this stage (from the model when it says so), and
    vLLM's whole partition (from `get_pp_indices`, which reads VLLM_PP_LAYER_PARTITION)."""
    from vllm.distributed.utils import get_pp_indices

    total = model_config.get_total_num_hidden_layers()
    ranges = [get_pp_indices(total, stage, place.pp_size) for stage in range(place.pp_size)]
    partition = tuple(end - start for start, end in ranges)
    for module in (getattr(model, "model", None), model):
        start, end = getattr(module, "start_layer", None), getattr(module, "end_layer", None)
        if isinstance(start, int) and isinstance(end, int):
            return (start, end), partition
    return ranges[place.pp_rank], partition


def check_layers(
    artifact: Path,
    manifest: Manifest,
    place: RankPlace,
    built: tuple[int, int],
    vllm_partition: tuple[int, ...],
) -> None:
    partition = manifest.topology.partition
    start = sum(partition[: place.pp_rank])
    expected = (start, start + partition[place.pp_rank])
    if built == expected:
        return
    ours, theirs = ",".join(map(str, partition)), ",".join(map(str, vllm_partition))
    raise TopologyMismatchError(
        f"artifact {artifact} puts layers {expected[0]}-{expected[1] - 1} on stage "
        f"{place.pp_rank} (partition {ours}) but vLLM built layers {built[0]}-{built[1] - 1} "
        f"there (partition {theirs}); start vLLM with VLLM_PP_LAYER_PARTITION={ours}, or "
        f"convert again with VLLM_PP_LAYER_PARTITION={theirs} set"
    )


def check_moe(
    artifact: Path, manifest: Manifest, entry: ModelEntry, model: nn.Module, place: RankPlace
) -> None:
    """Expert parallelism, placement and the device-dependent expert layout."""
    if entry.experts is None:
        return
    running = RunningExperts.current(model, place.tp_rank)
    if running is None:
        return
    hint = f"shardprep convert {_source(manifest)} --tp {place.tp_size} --pp {place.pp_size} "
    check_experts(artifact, entry.experts, running, hint + "EP_FLAGS-o NEW")
    files = entry.rank_params(place.pp_rank, place.tp_rank, place.dp_rank)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_device_layout(artifact, entry.experts, files, built)


def _source(manifest: Manifest) -> str:
    target = manifest.model("target")
    return target.source.model if target is not None and target.source.model else "MODEL"


def _ignorable(entry: ModelEntry, place: RankPlace) -> set[str]:
    """File tensors vLLM builds only when an EAGLE draft runs with pp > 1."""
    return {name for name, stage in entry.spec_decode_only if stage == place.pp_rank}


def _may_lack(entry: ModelEntry) -> set[str]:
    """Draft parameters that vLLM shares with the target when the draft lacks them, or
    leaves at their initial value (the draft family says which)."""
    if entry.role != "draft":
        return set()
    family = draft_family(entry)
    return set(entry.shared_with_target) | set(getattr(family, "may_stay_unloaded", ()))


def draft_family(entry: ModelEntry) -> Any:
    """The draft's family, whose hooks redo what vLLM's own `load_weights` does besides
    copying (e.g. DFlash's fused KV buffers); None for a target."""
    if entry.role != "draft" or not entry.method:
        return None
    from shardprep import archs

    return archs.draft_family(entry.method)


def _device_of(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.device) if param is not None else "cpu"


class Destinations:
    """Where the reader may put a tensor directly: the parameter (or buffer) of that
    name, when it is contiguous, of the exact shape and dtype, and not handed out yet.
    Anything else gets None, and `fill_parameters` reports it."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors, self.canonical = _parameters(model)
        self.claimed: set[str] = set()

    def __call__(self, name: str, info: TensorInfo) -> torch.Tensor | None:
        target = self.tensors.get(name)
        if target is None or self.canonical[name] in self.claimed:
            return None
        data = target.data
        if tuple(data.shape) != info.shape or data.dtype != torch_dtypes(torch).get(info.dtype):
            return None
        if not data.is_contiguous() or data.device.type != "cpu":
            return None
        self.claimed.add(self.canonical[name])
        return data


@dataclass
class Problems:
    """What did not fit, collected over the whole rank and raised once."""

    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)
    shape: list[str] = field(default_factory=list)
    dtype: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            (self.missing, "parameter(s) missing from the files"),
            (self.extra, "tensor(s) the model does not have"),
            (self.twice, "parameter(s) filled more than once"),
            (self.shape, "shape mismatch(es)"),
            (self.dtype, "dtype mismatch(es)"),
        ]
        found = [f"{len(items)} {what} ({summarize(items)})" for items, what in parts if items]
        return "; ".join(found)


def fill_parameters(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    ignorable: set[str],
    may_lack: set[str],
    where: str,
    layout: str = "",
) -> list[str]:
    """Copy each tensor into the parameter of the same name (tied aliases count as the
    parameter they alias); every parameter must be filled exactly once with the exact
    shape and dtype, except those in `may_lack`. A tensor may also fill a buffer (e.g.
    attention scales), which is never required. Tensors in `ignorable` that the model
    lacks are skipped. Returns the names filled; raises one error listing every problem."""
    params, canonical = _parameters(model)
    required = {name for name, _ in model.named_parameters()}
    problems, filled, seen = Problems(), {}, set()
    for name, tensor in tensors:
        if name in params:
            if _fill_one(name, tensor, params[name], canonical[name] in seen, problems):
                filled[canonical[name]] = name
            seen.add(canonical[name])
        elif name not in ignorable:
            problems.extra.append(name)
        del tensor  # let the reader free a part before it stages the next one
    problems.missing = [
        key
        for key, names in _aliases(canonical).items()
        if key in required and key not in seen and not names & may_lack
    ]
    if any(vars(problems).values()):
        raise WeightMismatchError(
            f"the rank files of {where} do not fit the model vLLM built: {problems.summary()}. "
            f"They follow vLLM layout {layout or 'unknown'}; convert again with a shardprep "
            "that matches this vLLM, or load the original model with --load-format auto"
        )
    return list(filled.values())


def _fill_one(
    name: str, tensor: torch.Tensor, target: torch.Tensor, seen: bool, problems: Problems
) -> bool:
    """Copy one tensor if it fits; else record why not."""
    if seen:
        problems.twice.append(name)
    elif tuple(tensor.shape) != tuple(target.shape):
        problems.shape.append(f"{name}: file {tuple(tensor.shape)}, model {tuple(target.shape)}")
    elif tensor.dtype != target.dtype:
        problems.dtype.append(f"{name}: file {tensor.dtype}, model {target.dtype}")
    else:
        if tensor.data_ptr() != target.data_ptr():  # else it was read straight into it
            target.data.copy_(tensor)
        return True
    return False


def _parameters(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter name (tied aliases included), and the first name of each; then the
    buffers, likewise (they may be filled, they are not required)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    canonical = {name: first.setdefault(id(p), name) for name, p in tensors.items()}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        tensors[name] = buffer
        canonical[name] = first.setdefault(id(buffer), name)
    return tensors, canonical


def _aliases(canonical: dict[str, str]) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for name, key in canonical.items():
        names.setdefault(key, set()).add(name)
    return names


def mark_eagle_weights(model: nn.Module, names: Iterable[str]) -> None:
    """What EAGLE/EAGLE3 `load_weights` sets as a side effect: `has_own_lm_head` and
    `has_own_embed_tokens` when the draft's files hold them (else vLLM shares the
    target's modules)."""
    from vllm.model_executor.models.utils import process_eagle_weight

    for name in names:
        process_eagle_weight(model, name)
