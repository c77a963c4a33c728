"""Rank-local reading of an artifact: only this rank's files, no collective of any kind.

Each part file is checked first (present, the size the manifest records, a strict header
that lists exactly the tensors the manifest gives this rank, and the sha256 when
`verify`), then read with fastsafetensors on a `SingleGroup` (GDS when the device is
CUDA and `/dev/nvidia-fs*` exists, else its no-GDS path), one part at a time, so the
extra memory is one part. When fastsafetensors is missing or fails on a file, the rest
of the process reads with safetensors' `safe_open`; which path was taken, and why, is
logged once per process. On the CPU, a caller that can say where each tensor belongs
(`into`) gets it copied there from a few small reused buffers that the disk fills with
`O_DIRECT` reads, several at once, ahead of the copies; a file the page cache holds
whole is read straight into the destinations instead (see `read_into`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardprep.constants import MANIFEST_NAME
from shardprep.errors import (
    CorruptFileError,
    MissingRankFileError,
    ShardprepError,
    TopologyMismatchError,
    summarize,
)
from shardprep.format.dtypes import TORCH_DTYPE_NAMES
from shardprep.format.headers import (
    Header,
    TensorInfo,
    read_header,
    sha256_file,
)
from shardprep.format.manifest import FileEntry, Manifest, ParamSpec, rank_key, read_manifest

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("shardprep.loader")

BACKENDS = ("auto", "fastsafetensors", "safetensors")
GDS_DEVICES = "/dev/nvidia-fs*"


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
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of rank (pp_rank, tp_rank) of `role` (and,
    where the experts are stored per dp rank, those of `dp_rank`).

    All of the rank's files are checked before the first tensor is yielded. Tensors are
    on `device`; each part's memory is released once its tensors are dropped. With
    `into`, on the CPU and the `auto` backend, each tensor is read straight into the
    contiguous tensor `into(name, info)` returns (and that one is yielded), or into a
    new tensor where it returns None.
    """
    artifact = Path(artifact)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    manifest = manifest if manifest is not None else read_manifest(artifact)
    files = check_rank_files(
        artifact, manifest, role, pp_rank, tp_rank, verify=verify, dp_rank=dp_rank
    )
    direct = into is not None and device == "cpu" and backend == "auto"
    for rank_file in files:
        if direct:
            _announce("direct", "device cpu: each tensor is read straight into its parameter")
            yield from read_into(rank_file.path, rank_file.header, into)  # type: ignore[arg-type]
        else:
            yield from read_file(rank_file.path, rank_file.header, device=device, backend=backend)


def read_into(
    path: Path, header: Header, into: Callable[[str, TensorInfo], torch.Tensor | None]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read each tensor of one checked file, in file order, into its destination.

    A file the page cache holds whole is read with one `pread` per tensor straight into
    its destination. Otherwise:

    The file is read front to back in `CHUNK_BYTES` pieces by a thread of its own into a
    few staging buffers that are reused (so their pages are faulted in once), while this
    thread copies each tensor's bytes from them into the destination: the disk works on
    the next chunks while this one is copied. A chunk that is in the page cache is
    copied from there; one that is not is read with `O_DIRECT`, disk to staging buffer,
    so that a cold read costs one copy and no page-cache work (see `_Chunks`)."""
    import torch

    dtypes = torch_dtypes(torch)
    items = sorted(header.tensors.items(), key=lambda item: item[1].offset)
    start = min((info.offset for _, info in items if info.nbytes), default=None)
    if start is None:  # nothing to read: empty tensors only
        for name, info in items:
            dest = into(name, info)
            yield (
                name,
                dest if dest is not None else torch.empty(info.shape, dtype=dtypes[info.dtype]),
            )
        return
    end = max(info.offset + info.nbytes for _, info in items)
    if _all_cached(path, start, end):
        yield from _read_cached(path, items, into)
        return
    with _Chunks(path, start, end) as chunks:
        for name, info in items:
            dest = into(name, info)
            if dest is None:
                dest = torch.empty(info.shape, dtype=dtypes[info.dtype])
            if info.nbytes:
                chunks.copy_to(dest.reshape(-1).view(torch.uint8), info.offset)
            yield name, dest


def _all_cached(path: Path, start: int, end: int) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        residency = _Residency.of(fd, os.fstat(fd).st_size)
        if residency is None:
            return False
        try:
            return _resident_prefix(residency, start, end - start) == end - start
        finally:
            residency.close()
    finally:
        os.close(fd)


def _read_cached(
    path: Path,
    items: list[tuple[str, TensorInfo]],
    into: Callable[[str, TensorInfo], torch.Tensor | None],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A file the page cache holds whole: one `pread` per tensor straight into its
    destination (one copy, by the kernel; staging would add a second)."""
    import torch

    dtypes = torch_dtypes(torch)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, info in items:
            dest = into(name, info)
            if dest is None:
                dest = torch.empty(info.shape, dtype=dtypes[info.dtype])
            view = memoryview(dest.reshape(-1).view(torch.uint8).numpy()).cast("B")
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], info.offset + done)
                if n == 0:
                    raise CorruptFileError(
                        f"{path} ended early at byte {info.offset + done:,}", path=str(path)
                    )
                done += n
            yield name, dest
    finally:
        os.close(fd)


CHUNK_BYTES = 16 << 20
"""The size of one read (a multiple of `ALIGN`)."""
STAGING_BUFFERS = 4
"""Chunks in memory at once per file being read, and reads in flight: the copy works on
one while the disk fills the others (so 64 MiB per rank with the default chunk)."""
READ_THREAD = "shardprep-read"
ALIGN = 4096
"""Alignment of `O_DIRECT` offsets, lengths and buffers (a page: above any logical block
size Linux asks for)."""


class _Chunks:
    """The bytes [start, end) of a file, read ahead in aligned chunks by a few threads.

    Up to `STAGING_BUFFERS` chunks are read at once, each by a thread of its own into a
    buffer that is reused for a later chunk once it has been copied from (so its pages
    are faulted in once, and the disk has several reads queued). The part of a chunk
    that the page cache holds (asked with `mincore`, which reads nothing) is read from
    there; the rest, from the first page that is not cached, with `O_DIRECT` straight
    into the buffer, which skips the page cache's allocation and bookkeeping and its
    copy. Where `O_DIRECT` is not available (tmpfs, another OS) or is refused, plain
    reads do the same job. The consumer takes chunks in file order with `copy_to`;
    closing cancels the reads not started and waits for the others."""

    def __init__(self, path: Path, start: int, end: int) -> None:
        import torch

        self.path, self.end = path, end
        base = start - start % ALIGN
        self.offsets = list(range(base, end, CHUNK_BYTES))
        count = min(STAGING_BUFFERS, len(self.offsets))
        self.buffers = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(count)]
        self.views = [torch.frombuffer(b, dtype=torch.uint8) for b in self.buffers]
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd = _open_direct(path)
        self.direct = self.direct_fd is not None
        self.residency = _Residency.of(self.fd, os.fstat(self.fd).st_size)
        self.pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix=READ_THREAD)
        self.pending: deque[tuple[int, int, Future[int]]] = deque()
        self.submitted = 0
        self.current: tuple[int, int, int] | None = None  # (buffer, offset, length)
        for index in range(count):
            self._submit(index)

    def __enter__(self) -> _Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for _, _, future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=True)
        self.pending.clear()
        if self.residency is not None:
            self.residency.close()
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        self.views.clear()
        for buffer in self.buffers:
            with contextlib.suppress(BufferError):  # still viewed (a traceback): left to gc
                buffer.close()

    def _submit(self, index: int) -> None:
        """Read the next chunk not yet asked for into buffer `index`."""
        if self.submitted < len(self.offsets):
            offset = self.offsets[self.submitted]
            self.submitted += 1
            view = memoryview(self.buffers[index])
            self.pending.append((index, offset, self.pool.submit(self._read_chunk, view, offset)))

    def _read_chunk(self, view: memoryview, offset: int) -> int:
        want = min(CHUNK_BYTES, self.end - offset)
        cached = _resident_prefix(self.residency, offset, want)
        done = 0
        while done < cached:  # from the page cache
            n = os.preadv(self.fd, [view[done:cached]], offset + done)
            if n == 0:
                break
            done += n
        while done < want:
            n = self._read_some(view, offset + done, done, want)
            if n == 0:
                raise CorruptFileError(
                    f"{self.path} ended early at byte {offset + done:,}", path=str(self.path)
                )
            done += n
        return want

    def _read_some(self, view: memoryview, at: int, done: int, want: int) -> int:
        if self.direct and at % ALIGN == 0:
            # Whole pages up to the chunk's end (which may pass `end`; a read past the
            # end of the file returns short).
            length = -(-(want - done) // ALIGN) * ALIGN
            try:
                n = os.preadv(self.direct_fd, [view[done : done + length]], at)  # type: ignore[arg-type]
                return min(n, want - done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # refused here: plain reads from now on
        return os.preadv(self.fd, [view[done:want]], at)

    def copy_to(self, dest: torch.Tensor, offset: int) -> None:
        """Copy the file's bytes [offset, offset + len(dest)) into `dest` (1-D uint8);
        offsets must not go back."""
        done = 0
        while done < dest.numel():
            index, start, length = self._chunk_at(offset + done)
            begin = offset + done - start
            n = min(length - begin, dest.numel() - done)
            dest[done : done + n].copy_(self.views[index][begin : begin + n])
            done += n

    def _chunk_at(self, offset: int) -> tuple[int, int, int]:
        while self.current is None or offset >= self.current[1] + self.current[2]:
            if self.current is not None:
                self._submit(self.current[0])  # its buffer is free for the next chunk
            if not self.pending:
                raise CorruptFileError(f"{self.path} ended early", path=str(self.path))
            index, start, future = self.pending.popleft()
            self.current = (index, start, future.result())
        return self.current


def _open_direct(path: Path) -> int | None:
    """A second descriptor with `O_DIRECT`, where the platform and file system allow."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


def _resident_prefix(residency: _Residency | None, offset: int, length: int) -> int:
    """How many bytes from `offset` on (up to `length`) the page cache holds, in whole
    pages, or `length` if it holds them all; 0 where that cannot be asked."""
    return residency.prefix(offset, length) if residency is not None else 0


class _Residency:
    """Which pages of a file are in the page cache (`mincore` over a mapping that is
    never touched, so asking reads nothing and changes nothing)."""

    def __init__(self, fd: int, size: int) -> None:
        import ctypes

        self.ctypes = ctypes
        self.mincore = ctypes.CDLL(None, use_errno=True).mincore
        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self.anchor = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self.anchor)

    @classmethod
    def of(cls, fd: int, size: int) -> _Residency | None:
        try:
            return cls(fd, size) if size else None
        except (OSError, AttributeError, ValueError, TypeError):
            return None

    def prefix(self, offset: int, length: int) -> int:
        ctypes = self.ctypes
        start = offset - offset % mmap.PAGESIZE
        span = offset + length - start
        pages = (ctypes.c_ubyte * (-(-span // mmap.PAGESIZE)))()
        if self.mincore(ctypes.c_void_p(self.address + start), ctypes.c_size_t(span), pages):
            return 0
        first_missing = bytes(pages).find(b"\x00")  # bit 0 is the only one Linux sets
        if first_missing < 0:
            return length
        return max(0, min(length, start + first_missing * mmap.PAGESIZE - offset))

    def close(self) -> None:
        del self.anchor
        self.map.close()


def torch_dtypes(torch: Any) -> dict[str, torch.dtype]:
    """safetensors dtype names -> torch dtypes (torch passed in: imported lazily)."""
    return {key: getattr(torch, value) for key, value in TORCH_DTYPE_NAMES.items()}


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
    path: Path, header: Header, *, device: str = "cpu", backend: str = "auto"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of one checked file, in file order, with the chosen backend."""
    names = [n for n, _ in sorted(header.tensors.items(), key=lambda item: item[1].offset)]
    if backend == "safetensors" or (backend == "auto" and _state.fast_unusable):
        _announce("safetensors", _state.fast_unusable or "the safetensors backend was requested")
        yield from _read_safetensors(path, names, device)
        return
    try:
        opened = _open_fast(path, device)
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
    """Process-wide: why fastsafetensors cannot be used here (None while it can), and
    which paths were already announced."""

    fast_unusable: str | None = None
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


def use_gds(device: str) -> bool:
    """GDS only for a CUDA device on a machine with the nvidia-fs driver loaded."""
    return device.startswith("cuda") and bool(glob.glob(GDS_DEVICES))


@dataclass
class _FastFile:
    loader: object
    buffer: object
    why: str

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors own a share of the file's buffer: it is freed when they are dropped."""
        try:
            for name in names:
                yield name, self.buffer.get_tensor(name)  # type: ignore[attr-defined]
        finally:
            self.buffer.close()  # type: ignore[attr-defined]
            self.loader.close()  # type: ignore[attr-defined]


def _open_fast(path: Path, device: str) -> _FastFile:
    """Stage one whole file on `device` with fastsafetensors on a single-process group."""
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except ImportError as exc:
        raise RuntimeError(f"fastsafetensors is not importable ({exc})") from exc
    gds = use_gds(device)
    loader = SafeTensorsFileLoader(SingleGroup(), device=device, nogds=not gds)
    try:
        loader.add_filenames({0: [str(path)]})
        buffer = loader.copy_files_to_device()
    except BaseException:
        loader.close()
        raise
    why = "GDS" if gds else f"no GDS: device {device}, {_gds_absence(device)}"
    return _FastFile(loader, buffer, why)


def _gds_absence(device: str) -> str:
    if not device.startswith("cuda"):
        return "GDS needs a CUDA device"
    return f"no {GDS_DEVICES} on this machine"


def _read_safetensors(
    path: Path, names: list[str], device: str
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=device) as handle:
        for name in names:
            yield name, handle.get_tensor(name)
