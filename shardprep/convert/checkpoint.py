"""Reading a source checkpoint: config, index, safetensors headers, ranged reads."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple

from shardprep.constants import (
    COPIED_FILE_PATTERNS,
    MAX_JSON_BYTES,
    MAX_SIDE_FILE_BYTES,
)
from shardprep.errors import ConfigError, CorruptFileError, printable, summarize
from shardprep.format import jsonio
from shardprep.format.checks import is_extra_file_path
from shardprep.format.headers import Header, TensorInfo, read_header
from shardprep.plan import archs

if TYPE_CHECKING:
    from shardprep.hub_client import Remote

INDEX_NAME = "model.safetensors.index.json"
# Where `hf download --local-dir` keeps what it knows of each file it fetched.
LOCAL_DIR_DOWNLOAD_METADATA = (".cache", "huggingface", "download")
MAX_METADATA_BYTES = 4096


class SourceTensor(NamedTuple):
    """One tensor of a checkpoint (a named tuple: a flagship has half a million)."""

    name: str
    file: str  # relative to the checkpoint folder
    info: TensorInfo


@dataclass(frozen=True)
class Checkpoint:
    """A model folder: its config and where every tensor's bytes lie."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, SourceTensor]
    files: tuple[str, ...]
    repo_id: str | None = None
    revision: str | None = None
    known_sha256: dict[str, str] | None = None  # what the Hub states, for a Hub source
    # A Hub source planned from its metadata: each file's size as the Hub lists it (a
    # file arrives under `root` only once it is downloaded) and where to fetch it.
    sizes: dict[str, int] | None = None
    remote: Remote | None = None
    # What the plan read of a Hub source by range request (each weight file's header, and
    # any tensor read before its file was here): (file, offset, length) -> sha256 of the
    # bytes. The file that arrives must hold the same bytes there. Shared by the copies
    # `dataclasses.replace` makes, which go on recording into it.
    range_reads: dict[tuple[str, int, int], str] = field(default_factory=dict)
    # Tensors read from a side file rather than a safetensors file (a draft's mask
    # embedding), or computed from other tensors (file ""; convert/dequantize.py): name ->
    # raw bytes, described by `tensors[name]` with offset 0.
    side_tensors: dict[str, bytes] = field(default_factory=dict)

    def side_files(self) -> list[str]:
        return sorted({f for name in self.side_tensors if (f := self.tensors[name].file)})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: t.info.shape for name, t in self.tensors.items()}

    def size(self, file: str) -> int:
        if self.sizes is not None and file in self.sizes:
            return self.sizes[file]
        return (self.root / file).stat().st_size

    def read(
        self, file: str, offset: int, length: int, into: bytearray | None = None
    ) -> bytes | bytearray:
        """Bytes of a source file: from the folder, or by range request from the Hub for
        a file not downloaded yet (or whose cached copy is not the blob the Hub's sha256
        names). `into`: a buffer of `length` bytes that a local read fills and returns
        (a fresh one per read costs a page fault per page)."""
        path = self.root / file
        if self.remote is not None and self.revision is not None and not self.cached(file):
            data = self.remote.read_range(self.revision, file, offset, length)
            self.range_reads[(file, offset, length)] = hashlib.sha256(data).hexdigest()
            return data
        with open(path, "rb") as handle:
            if into is None or len(into) != length:
                return os.pread(handle.fileno(), length, offset)
            if os.preadv(handle.fileno(), [into], offset) != length:
                return os.pread(handle.fileno(), length, offset)  # short: as pread reads
            return into

    def cached(self, file: str) -> bool:
        """Whether a Hub source's file is here as the blob named by its stated sha256."""
        expected = (self.known_sha256 or {}).get(file)
        if expected is None:
            return (self.root / file).exists()
        return cached_hub_sha256(self, file) == expected and (self.root / file).is_file()


def is_repo_id_shape(model: str) -> bool:
    """Whether `model`, which is not a folder here, reads as a Hub repo id (org/name)."""
    path = Path(model).expanduser()
    return not path.exists() and model.count("/") == 1 and not model.startswith((".", "/", "~"))


def resolve_model(model: str) -> Path:
    """A local model folder; anything else is refused (a Hub repo id is opened by
    `hub_source.open_source`)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{model} is neither a model folder nor a Hugging Face repo id")
    return path


def open_checkpoint(
    model: str | Path, repo_id: str | None = None, revision: str | None = None
) -> Checkpoint:
    """A model folder (a Hugging Face cache snapshot of `repo_id`@`revision`, if given)."""
    root = resolve_model(str(model))
    _require_utf8(str(root.resolve()), "folder", root)
    config = dict(archs.read_config(load_config(root)))
    weight_map = read_index(root / INDEX_NAME) if (root / INDEX_NAME).is_file() else None
    files = _weight_files(root, weight_map)
    copied = {p.name for pattern in COPIED_FILE_PATTERNS for p in root.glob(pattern)}
    for name in sorted({*files, *copied}):
        _require_utf8(name, "file", root / name)
    for name in sorted(copied):
        require_recordable(name, root)
        _require_own_file(root / name)
    tensors = collect_tensors(root, [(file, read_header(root / file)) for file in files])
    check_index(root / INDEX_NAME, weight_map, tensors)
    return Checkpoint(root, config, tensors, tuple(files), repo_id, revision)


def collect_tensors(root: Path | str, headers: list[tuple[str, Header]]) -> dict[str, SourceTensor]:
    """Every tensor of the files' headers, by name; a name in two files is refused."""
    tensors: dict[str, SourceTensor] = {}
    for file, header in headers:
        if not tensors.keys().isdisjoint(header.tensors):
            name = next(name for name in header.tensors if name in tensors)
            raise CorruptFileError(
                f"tensor {name} appears in both {tensors[name].file} and {file} of {root}; "
                "remove the duplicate file",
                path=f"{root}/{file}",
            )
        tensors.update((n, SourceTensor(n, file, info)) for n, info in header.tensors.items())
    return tensors


def _require_utf8(name: str, what: str, path: Path) -> None:
    """The manifest records source names as UTF-8 JSON, which every reader insists on: a
    name that is not valid UTF-8 (kept by Python as lone surrogates) is refused before
    anything is written."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = printable(repr(os.fsencode(path))[2:-1], 300)  # the bytes that are not UTF-8
        raise ConfigError(
            f"the source {what} {shown} has a name that is not valid UTF-8, which the "
            "manifest cannot record; rename it (e.g. `convmv -f latin1 -t utf8`) and rerun"
        ) from None


def require_recordable(name: str, root: Path | str) -> None:
    """A file copied next to the shards must have a name the artifact's reader accepts
    (format/checks.py): one with a control character or a backslash, or a temporary
    file's, is refused before anything is written, not by the reader afterwards."""
    if not is_extra_file_path(name, has_draft=False):
        raise ConfigError(
            f"the source file {printable(repr(name)[1:-1], 300)} in {printable(root, 300)} "
            "has a name that an artifact cannot hold (a control character, a backslash or "
            "a temporary file's ending), and shardprep copies every config and tokenizer "
            "file; rename or remove it (a Hub repo's: in a downloaded copy) and rerun"
        )


def _require_own_file(path: Path) -> None:
    """A copied file is published with the artifact: a link may lead to a file of the
    model folder or to a Hugging Face cache blob (`<cache>/models--org--name/blobs/`, where
    a snapshot's files and `--local-dir` downloads link), never to any other file."""
    if not path.is_symlink():
        return
    target = path.resolve()
    blob = target.parent.name == "blobs" and target.parent.parent.name.startswith("models--")
    if not blob and not target.is_relative_to(path.parent.resolve()):
        raise ConfigError(
            f"the source file {printable(path, 300)} is a link to {printable(target, 300)}, "
            "outside the model folder, and would be copied into the artifact and published "
            "with it; put a copy of the file in the model folder instead of the link"
        )


def _require_regular(path: Path) -> None:
    """A FIFO or a device would block or never end: read regular files only."""
    if not path.is_file():
        raise ConfigError(
            f"{path} is not a regular file (a FIFO, device or folder); shardprep reads only "
            "regular files: replace it with the real file"
        )


def load_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if path.exists():
        _require_regular(path)
    if not path.is_file():
        raise ConfigError(
            f"{root} has no config.json; point shardprep at a Hugging Face model folder"
        )
    try:
        config = jsonio.parse_file(path, limit=MAX_JSON_BYTES)
    except jsonio.JSONProblem as exc:
        raise ConfigError(f"{path} {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return config


def _weight_files(root: Path, weight_map: dict[str, str] | None) -> list[str]:
    index = root / INDEX_NAME
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).exists()]
        for file in files:
            if file not in missing:
                _require_regular(root / file)
        if missing:
            raise ConfigError(
                f"{index} names {summarize(missing)}, missing from {root}; "
                "download the whole checkpoint again"
            )
        return files
    files = sorted(p.name for p in root.glob("*.safetensors"))
    for file in files:
        _require_regular(root / file)
    if not files:
        raise ConfigError(
            f"{root} holds no *.safetensors files; shardprep reads safetensors checkpoints only"
        )
    return files


def read_index(index: Path) -> dict[str, str]:
    size = index.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ConfigError(
            f"{index} is {size:,} bytes, over the {MAX_JSON_BYTES:,}-byte limit for an index"
        )
    return parse_index(index.read_bytes(), str(index))


def parse_index(raw: bytes, where: str = INDEX_NAME) -> dict[str, str]:
    """The weight_map of a `model.safetensors.index.json`: tensor name -> a relative
    `*.safetensors` path inside the model folder."""
    try:
        document = jsonio.parse(raw, limit=MAX_JSON_BYTES)
    except jsonio.JSONProblem as exc:
        raise ConfigError(f"{where} {exc}; it is not a safetensors index") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise ConfigError(
            f"{where} has no weight_map object; it is not a safetensors index "
            "(remove it to read every *.safetensors file of the folder)"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise ConfigError(
                f"{where} maps {jsonio.shorten(name)!r} to {jsonio.shorten(repr(file))}, "
                "not to a file name"
            )
    # Hundreds of thousands of names share a few dozen files.
    for file in dict.fromkeys(weight_map.values()):  # in order, each once
        if not _is_weight_file_name(file):
            raise ConfigError(
                f"{where} names {jsonio.shorten(file)!r}, which is not a *.safetensors file "
                "inside the model folder"
            )
    return weight_map


def _is_weight_file_name(file: str) -> bool:
    pure = PurePosixPath(file)
    return (
        file.endswith(".safetensors")
        and not pure.is_absolute()
        and ".." not in pure.parts
        and not any(ch == "\\" or ord(ch) < 0x20 for ch in file)
    )


def check_index(
    index: Path, weight_map: dict[str, str] | None, tensors: dict[str, SourceTensor]
) -> None:
    """Every tensor the index (`weight_map`, read from `index`; None without one) names is
    in the file it names."""
    if weight_map is None:
        return
    absent = [
        name
        for name, file in weight_map.items()
        if tensors.get(name) is None or tensors[name].file != file
    ]
    if absent:
        raise CorruptFileError(
            f"{index} places {summarize(absent)} in files that do not hold them; "
            "the checkpoint is inconsistent: download it again",
            path=str(index),
        )


def cached_hub_sha256(checkpoint: Checkpoint, file: str) -> str | None:
    """A file in the Hugging Face cache links to a blob named by its sha256 (the Hub's
    LFS object id) in the repo's `blobs` folder."""
    path = checkpoint.root / file
    if not path.is_symlink():
        return None
    blob = path.resolve()
    if blob.parent.name != "blobs":
        return None
    return blob.name if _is_sha256(blob.name) else None


@dataclass(frozen=True)
class KnownSha256:
    """A source file's sha256 as something other than its bytes states it."""

    sha256: str
    claim: str  # whose word it is, for an error message


def known_sha256(checkpoint: Checkpoint, file: str) -> KnownSha256 | None:
    """The sha256 of a source file, known without reading it: a Hugging Face cache blob's
    name, what `hf download --local-dir` recorded when it fetched the file, or (for a Hub
    source) what the Hub states, which a download is checked against on arrival."""
    if checkpoint.known_sha256 and file in checkpoint.known_sha256:
        return KnownSha256(checkpoint.known_sha256[file], "the sha256 the Hub states")
    blob = cached_hub_sha256(checkpoint, file)
    if blob is not None:
        return KnownSha256(blob, "the sha256 its Hugging Face cache blob is named by")
    recorded = local_dir_sha256(checkpoint.root, file)
    if recorded is not None:
        where = local_dir_metadata_path(checkpoint.root, file)
        return KnownSha256(recorded, f"the sha256 recorded when it was downloaded ({where})")
    return None


def local_dir_metadata_path(root: Path, file: str) -> Path:
    parts = PurePosixPath(file).parts
    return root.joinpath(*LOCAL_DIR_DOWNLOAD_METADATA, *parts[:-1], parts[-1] + ".metadata")


def local_dir_sha256(root: Path, file: str) -> str | None:
    """A file fetched by `hf download --local-dir` has a metadata file in
    `.cache/huggingface/download/`: three lines, the commit, the file's etag (for an LFS
    file, its sha256; a git sha1 otherwise) and the time they were written. huggingface_hub
    trusts them while the file's mtime is not past that time, with 1 s of slack (its
    `read_download_metadata`); so does this. Anything else: None (the file is hashed)."""
    metadata = local_dir_metadata_path(root, file)
    try:
        if not metadata.is_file() or metadata.stat().st_size > MAX_METADATA_BYTES:
            return None
        lines = metadata.read_text(encoding="utf-8").splitlines()
        etag, timestamp = lines[1].strip(), float(lines[2].strip())
        modified = (root / file).stat().st_mtime
    except (OSError, ValueError, IndexError):  # UnicodeDecodeError is a ValueError
        return None
    if not math.isfinite(timestamp) or modified - 1 > timestamp or not _is_sha256(etag):
        return None
    return etag


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def load_side_file(path: Path) -> Any:
    """What a side file (a draft's `.pt` tensors) holds, unpickled safely
    (`torch.load(weights_only=True)`), its size checked first."""
    size = path.stat().st_size
    if size > MAX_SIDE_FILE_BYTES:
        raise ConfigError(
            f"{path} is {size:,} bytes, more than a draft's side file can be "
            f"({MAX_SIDE_FILE_BYTES:,}); remove it or replace it with the right file"
        )
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # the unpickler raises many kinds; all mean "unusable"
        # torch's own message spans lines and suggests loading the file unsafely: not that.
        raise ConfigError(
            f"{path} is not a file of plain tensors (a safe load refused it with "
            f"{type(exc).__name__}); use the file that came with this draft"
        ) from None
