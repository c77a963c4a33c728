"""Rank-local reading of an artifact: only this rank's files, no collective of any kind.

Each part file is checked first (present, the size the manifest records, a strict header
that lists exactly the tensors the manifest gives this rank, and the sha256 when
`verify`), then read with fastsafetensors on a `SingleGroup` (GDS where `gds.py` says so,
else its no-GDS path), one part at a time, so the extra memory is one part. Where GDS
fails on a file, it and the rest are read without GDS; when fastsafetensors is missing or
fails on a file, the rest of the process reads with safetensors' `safe_open`; which path
was taken, and why, is logged once per process. On the CPU, a caller that can say where
each tensor belongs (`into`) gets it copied there (`shardprep.loader.cpu_read`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from shardprep.constants import MANIFEST_NAME
from shardprep.errors import (
    CorruptFileError,
    MissingRankFileError,
    ShardprepError,
    TopologyMismatchError,
    summarize,
)
from shardprep.format.headers import Header, TensorInfo, read_header
from shardprep.format.manifest import FileEntry, Manifest, ParamSpec, rank_key, read_manifest
from shardprep.hashing import sha256_file
from shardprep.loader.cpu_read import read_into
from shardprep.loader.gds import GdsChoice, GdsRequest

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("shardprep.loader")

BACKENDS = ("auto", "fastsafetensors", "safetensors")


@dataclass(frozen=True)
class RankFile:
    """One checked part file of a rank: where it is, what the manifest says, its header."""

    path: Path
    entry: FileEntry
    header: Header


def read_rank(
    artifact: Path,
    role: str,
    pp_rank: int,
    tp_rank: int,
    *,
    manifest: Manifest | None = None,
    device: str = "cpu",
    verify: bool = False,
    backend: str = "auto",
    into: Callable[[str, TensorInfo], torch.Tensor | None] | None = None,
    dp_rank: int = 0,
    gds: GdsRequest | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of rank (pp_rank, tp_rank) of `role` (and,
    where the experts are stored per dp rank, those of `dp_rank`).

    All of the rank's files are checked before the first tensor is yielded. Tensors are
    on `device`; each part's memory is released once its tensors are dropped. With
    `into`, on the CPU and the `auto` backend, each tensor is read straight into the
    contiguous tensor `into(name, info)` returns (and that one is yielded), or into a
    new tensor where it returns None. `gds` says whether GPUDirect Storage may be used
    (by default: where one worker loads).
    """
    artifact = Path(artifact)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    manifest = manifest if manifest is not None else read_manifest(artifact)
    files = check_rank_files(
        artifact, manifest, role, pp_rank, tp_rank, verify=verify, dp_rank=dp_rank
    )
    direct = into if device == "cpu" and backend == "auto" else None
    for rank_file in files:
        if direct is not None:
            _announce("direct", "device cpu: each tensor is read straight into its parameter")
            yield from read_into(rank_file.path, rank_file.header, direct)
        else:
            yield from read_file(
                rank_file.path, rank_file.header, device=device, backend=backend, gds=gds
            )


def check_rank_files(
    artifact: Path,
    manifest: Manifest,
    role: str,
    pp_rank: int,
    tp_rank: int,
    *,
    verify: bool,
    dp_rank: int = 0,
) -> list[RankFile]:
    """The rank's part files, each present, of the recorded size, with a strict header
    that matches the manifest (and the recorded sha256 when `verify`)."""
    entries = manifest.rank_files(role, pp_rank, tp_rank, dp_rank)
    if not entries:
        raise _no_files(artifact, manifest, role, pp_rank, tp_rank)
    missing = [e.path for e in entries if not (artifact / e.path).is_file()]
    if missing:
        raise MissingRankFileError(
            f"{artifact} lacks {len(missing)} file(s) of {role} rank pp{pp_rank} tp{tp_rank} "
            f"that {MANIFEST_NAME} lists ({summarize(missing)}); re-run `shardprep convert` "
            f"into {artifact} (it resumes), or fetch stage {pp_rank} again",
            path=str(artifact / missing[0]),
        )
    files = [_check_file(artifact, entry, verify) for entry in entries]
    _check_against_manifest(artifact, manifest, role, pp_rank, tp_rank, files, dp_rank)
    return files


def _no_files(
    artifact: Path, manifest: Manifest, role: str, pp_rank: int, tp_rank: int
) -> ShardprepError:
    topo = manifest.topology
    if pp_rank not in manifest.stages:
        stages = ", ".join(map(str, manifest.stages))
        target = manifest.model("target")
        source = target.source.model if target is not None and target.source.model else "MODEL"
        return TopologyMismatchError(
            f"{artifact} holds only stage(s) {stages}, not stage {pp_rank}; for this node, "
            f"convert that stage (`shardprep convert {source} --tp {topo.tp} --pp {topo.pp} "
            f"--stage {pp_rank} -o OUT`) or fetch it (`shardprep fetch REPO --stage {pp_rank}`)"
        )
    if role == "draft" and manifest.model("draft") is None:
        return TopologyMismatchError(
            f"{artifact} has no draft model; convert it with `shardprep convert ... --draft DRAFT`"
        )
    if role == "draft":
        return TopologyMismatchError(
            f"{artifact} holds draft files for the last stage ({topo.pp - 1}) only, "
            f"not for stage {pp_rank}; vLLM builds drafts on the last stage"
        )
    return TopologyMismatchError(
        f"{artifact} has no {role} files for rank pp{pp_rank} tp{tp_rank}; it is "
        f"tp{topo.tp} x pp{topo.pp}: re-run `shardprep convert` for this topology"
    )


def _check_file(artifact: Path, entry: FileEntry, verify: bool) -> RankFile:
    path = artifact / entry.path
    size = path.stat().st_size
    if size != entry.bytes:
        raise CorruptFileError(
            f"{path} has {size:,} bytes but {MANIFEST_NAME} records {entry.bytes:,}; "
            f"it is truncated or was replaced: re-run `shardprep convert` into {artifact}",
            path=str(path),
        )
    header = read_header(path)
    if verify and sha256_file(path) != entry.sha256:
        raise CorruptFileError(
            f"{path} does not match the sha256 that {MANIFEST_NAME} records "
            f"({entry.sha256[:12]}...); its bytes changed: re-run `shardprep convert` "
            f"into {artifact} (it rewrites files that fail their hash) or fetch it again",
            path=str(path),
        )
    return RankFile(path, entry, header)


def _check_against_manifest(
    artifact: Path,
    manifest: Manifest,
    role: str,
    pp_rank: int,
    tp_rank: int,
    files: list[RankFile],
    dp_rank: int = 0,
) -> None:
    """The headers together hold exactly the tensors the manifest gives this rank."""
    model = manifest.model(role)
    if model is None or rank_key(pp_rank, tp_rank) not in model.ranks:
        return
    expected = model.rank_params(pp_rank, tp_rank, dp_rank)
    found: dict[str, ParamSpec] = {}
    for rank_file in files:
        for name, info in rank_file.header.tensors.items():
            found[name] = ParamSpec(info.dtype, info.shape)
    differ = sorted(n for n in set(found) | set(expected) if found.get(n) != expected.get(n))
    if differ:
        raise CorruptFileError(
            f"the {role} files of rank pp{pp_rank} tp{tp_rank} in {artifact} do not hold "
            f"what {MANIFEST_NAME} lists: {len(differ)} tensor(s) differ ({summarize(differ)}); "
            "re-run `shardprep convert` into a new folder",
            path=str(files[0].path),
        )


def read_file(
    path: Path,
    header: Header,
    *,
    device: str = "cpu",
    backend: str = "auto",
    gds: GdsRequest | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one checked file, in file order, with the chosen backend."""
    names = [n for n, _ in sorted(header.tensors.items(), key=lambda item: item[1].offset)]
    if backend == "safetensors" or (backend == "auto" and _state.fast_unusable):
        _announce("safetensors", _state.fast_unusable or "the safetensors backend was requested")
        yield from _read_safetensors(path, names, device)
        return
    try:
        opened = _open_fast(path, device, gds)
    except Exception as exc:
        if backend == "fastsafetensors":
            raise
        _state.fast_unusable = f"fastsafetensors failed on {path}: {type(exc).__name__}: {exc}"
        _announce("safetensors", _state.fast_unusable)
        yield from _read_safetensors(path, names, device)
        return
    _announce("fastsafetensors", opened.why)
    yield from opened.tensors(names)


@dataclass
class _State:
    """Process-wide: why fastsafetensors cannot be used here (None while it can), why
    GDS cannot (None while it may), and which paths were already announced."""

    fast_unusable: str | None = None
    gds_unusable: str | None = None
    announced: set[str] = field(default_factory=set)


_state = _State()


def _announce(path_key: str, why: str) -> None:
    if path_key in _state.announced:
        return
    _state.announced.add(path_key)
    if path_key == "fastsafetensors":
        logger.info("shardprep reads rank files with fastsafetensors (%s)", why)
    elif path_key == "direct":
        logger.info("shardprep reads rank files with plain reads (%s)", why)
    else:
        logger.warning("shardprep reads rank files with safetensors safe_open (%s)", why)


def backend_in_use() -> str:
    """'fastsafetensors' until it proved unusable in this process, then 'safetensors'."""
    return "safetensors" if _state.fast_unusable else "fastsafetensors"


class _Closes(Protocol):
    """fastsafetensors' SafeTensorsFileLoader, as used here."""

    def close(self) -> None: ...


class _Staged(_Closes, Protocol):
    """The files a SafeTensorsFileLoader copied to the device (its FilesBufferOnDevice)."""

    def get_tensor(self, name: str) -> torch.Tensor: ...


@dataclass
class _FastFile:
    loader: _Closes
    buffer: _Staged
    why: str

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors own a share of the file's buffer: it is freed when they are dropped."""
        try:
            for name in names:
                yield name, self.buffer.get_tensor(name)
        finally:
            self.buffer.close()
            self.loader.close()


def _open_fast(path: Path, device: str, gds: GdsRequest | None) -> _FastFile:
    """Stage one whole file on `device` with fastsafetensors on a single-process group;
    where GDS fails on it, the file (and every later one) is staged without GDS."""
    try:
        import fastsafetensors  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"fastsafetensors is not importable ({exc})") from exc
    choice = (gds or GdsRequest()).decide(device)
    if choice.use and _state.gds_unusable:
        choice = GdsChoice(False, _state.gds_unusable)
    if not choice.use:
        return _stage(path, device, choice)
    try:
        return _stage(path, device, choice)
    except Exception as exc:  # a file system that cuFile cannot register, a driver error
        _state.gds_unusable = f"no GDS: it failed on {path}: {type(exc).__name__}: {exc}"
        logger.warning("shardprep reads without GDS from now on (%s)", _state.gds_unusable)
        return _stage(path, device, GdsChoice(False, _state.gds_unusable))


def _stage(path: Path, device: str, choice: GdsChoice) -> _FastFile:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(SingleGroup(), device=device, nogds=not choice.use)
    try:
        loader.add_filenames({0: [str(path)]})
        buffer = loader.copy_files_to_device()
    except BaseException:
        loader.close()
        raise
    return _FastFile(loader, buffer, choice.why)


def _read_safetensors(
    path: Path, names: list[str], device: str
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=device) as handle:
        for name in names:
            yield name, handle.get_tensor(name)
