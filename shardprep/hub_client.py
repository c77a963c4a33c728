"""What the rest of shardprep needs from the Hugging Face Hub client: repo ids, the stored
name of a rank file, and `Remote`, which resolves a revision to a commit, lists a commit's
files with the sizes and sha256 the Hub states, gives the id the Hub keeps for a file,
reads a safetensors header by range request and downloads one file (into a folder or the
Hugging Face cache). Every failure of the client becomes a `HubError` that says what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeGuard

from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import (
    build_hf_headers,
    hf_raise_for_status,
    http_stream_backoff,
    validate_repo_id,
)

from shardprep import __version__
from shardprep.constants import MANIFEST_NAME
from shardprep.errors import ConfigError, HubError, ManifestError, printable
from shardprep.format import manifest as mf
from shardprep.format.headers import header_length
from shardprep.hashing import sha256_file
from shardprep.progress import Progress as tqdm

# The stored name of a compressed file is its logical path plus this suffix.
CODEC_SUFFIXES = {"zstd": ".zst"}
_COMMIT = re.compile(r"[0-9a-f]{40}")
RANGE_RETRIES = 3  # a range read whose connection drops is asked again this many times
RETRY_PAUSE_S = 0.5


def stored_path(entry: mf.FileEntry) -> str:
    """The name of a rank file in the repo: its path, plus `.zst` when compressed."""
    if entry.codec == "none":
        return entry.path
    suffix = CODEC_SUFFIXES.get(entry.codec)
    if suffix is None or entry.stored_bytes is None or entry.stored_sha256 is None:
        raise ManifestError(
            f"{MANIFEST_NAME} stores {entry.path} with codec {entry.codec!r} "
            f"(stored size {entry.stored_bytes}, sha256 {entry.stored_sha256}), which this "
            f"shardprep {__version__} cannot undo; upgrade shardprep"
        )
    return entry.path + suffix


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(
            f"{repo_id!r} is not a Hub repo id like org/Model-TP8-PP2 ({exc})"
        ) from None


def is_offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub read it at import."""
    return bool(constants.HF_HUB_OFFLINE)


def is_commit(revision: str | None) -> TypeGuard[str]:
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def is_connection_error(exc: BaseException) -> bool:
    # Matched by name: huggingface_hub's HTTP client (httpx, httpx2) differs by version.
    transport = any(cls.__name__ == "TransportError" for cls in type(exc).__mro__)
    return transport or isinstance(exc, (OfflineModeIsEnabled, ConnectionError))


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """A file of a commit as the Hub lists it."""

    path: str
    size: int
    sha256: str | None  # the LFS object id; None for a file stored in git


@dataclasses.dataclass(frozen=True)
class Remote:
    """One repo on one Hub endpoint, as the cache talks to it."""

    repo_id: str
    endpoint: str | None = None
    token: str | None = None
    progress: bool = True

    @property
    def where(self) -> str:
        return self.endpoint or constants.ENDPOINT

    def resolve(self, revision: str) -> str:
        """The commit id a branch, tag or commit names now."""
        if is_commit(revision):
            return revision
        with hub_errors(f"Resolving {self.repo_id}@{revision}", self.repo_id, self.endpoint):
            info = HfApi(endpoint=self.endpoint, token=self.token).repo_info(
                self.repo_id, revision=revision
            )
        if not is_commit(info.sha):
            raise HubError(f"{self.where} gave no commit id for {self.repo_id}@{revision}")
        return info.sha

    def file_id(self, commit: str, path: str) -> tuple[str, str]:
        """("sha256", hex) for a file in LFS, ("git-sha1", hex) for one stored in git."""
        with hub_errors(f"Looking up {path} in {self.repo_id}", self.repo_id, self.endpoint):
            infos = HfApi(endpoint=self.endpoint, token=self.token).get_paths_info(
                self.repo_id, [path], revision=commit
            )
        for info in infos:
            if isinstance(info, RepoFile) and info.path == path:
                return ("sha256", info.lfs.sha256) if info.lfs else ("git-sha1", info.blob_id)
        raise HubError(
            f"{self.repo_id}@{commit[:12]} has no {path}: it is not a shardprep artifact, or its "
            f"upload is incomplete. Publish it with `shardprep publish OUT {self.repo_id}`"
        )

    def list_files(self, commit: str) -> dict[str, RemoteFile]:
        """Every file of `commit`, by path (the tree endpoint, recursive)."""
        with hub_errors(f"Listing {self.repo_id}@{commit[:12]}", self.repo_id, self.endpoint):
            entries = list(
                HfApi(endpoint=self.endpoint, token=self.token).list_repo_tree(
                    self.repo_id, revision=commit, recursive=True
                )
            )
        return {
            e.path: RemoteFile(e.path, e.size, e.lfs.sha256 if e.lfs else None)
            for e in entries
            if isinstance(e, RepoFile)
        }

    def read_range(self, commit: str, path: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of a file, by one HTTP range request (asked again,
        up to RANGE_RETRIES times, when the connection drops); a server that ignores the
        range is refused before more than `length` bytes are read."""
        dropped = 0
        while True:
            try:
                return self._read_range(commit, path, start, length)
            except HubError as exc:
                dropped += 1
                if dropped > RANGE_RETRIES or not is_connection_error(exc.__cause__ or exc):
                    raise
                time.sleep(RETRY_PAUSE_S)

    def _read_range(self, commit: str, path: str, start: int, length: int) -> bytes:
        url = hf_hub_url(self.repo_id, path, revision=commit, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token)
        headers["Range"] = f"bytes={start}-{start + length - 1}"
        data = bytearray()
        action = f"Reading {path} of {self.repo_id}"
        stream = http_stream_backoff(
            "GET",
            url,
            headers=headers,
            follow_redirects=True,
            retry_on_exceptions=(),  # a body cut in the middle is asked again above
            retry_on_status_codes=(429,),
        )
        with hub_errors(action, self.repo_id, self.endpoint), stream as response:
            hf_raise_for_status(response)
            partial = response.status_code == 206
            if partial:
                for block in response.iter_bytes():
                    data += block
                    if len(data) > length:
                        break
        if not partial or len(data) != length:
            raise HubError(
                f"{self.where} did not answer a range request for bytes {start:,}-"
                f"{start + length - 1:,} of {self.repo_id}/{path} with exactly those bytes "
                f"(status {response.status_code}); shardprep reads a Hub source's headers by "
                "range: check HF_ENDPOINT, or download the model and pass its folder"
            )
        return bytes(data)

    @contextmanager
    def body(self, commit: str, path: str, start: int = 0) -> Iterator[tuple[int, Iterator[bytes]]]:
        """The bytes of a file from `start` on, by one GET (a range request `bytes=START-`
        when `start` is past 0, as huggingface_hub resumes). Yields the offset the bytes
        begin at: `start`, or 0 when the server sent the whole file instead."""
        url = hf_hub_url(self.repo_id, path, revision=commit, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token)
        if start:
            headers["Range"] = f"bytes={start}-"
        stream = http_stream_backoff(
            "GET",
            url,
            headers=headers,
            follow_redirects=True,
            timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
            retry_on_exceptions=(),  # a cut body is continued by the caller, from where it is
            retry_on_status_codes=(429,),
        )
        action = f"Downloading {path} of {self.repo_id}"
        with hub_errors(action, self.repo_id, self.endpoint), stream as response:
            hf_raise_for_status(response)
            offset = 0
            if start and response.status_code == 206:
                found = response.headers.get("Content-Range", "")
                if not found.startswith(f"bytes {start}-"):
                    raise HubError(
                        f"{self.where} answered a request for {self.repo_id}/{path} from byte "
                        f"{start:,} with other bytes ({printable(found, 80)}); check "
                        "HF_ENDPOINT, or delete the partial download and run again"
                    )
                offset = start
            yield offset, response.iter_bytes()

    def read_raw_header(self, commit: str, path: str, size: int) -> bytes:
        """The first bytes of a safetensors file, its 8-byte length and the header it
        declares (refused before it is read when over the limit), by two range requests:
        no tensor byte is read. The strict parser (`parse_header`) checks them."""
        where = f"{self.repo_id}@{commit[:12]}/{path}"
        prefix = self.read_range(commit, path, 0, 8) if size >= 8 else b""
        declared = header_length(where, prefix, size)
        return prefix + (self.read_range(commit, path, 8, declared) if declared else b"")

    def download_to_cache(self, revision: str, path: str) -> Path:
        """`path` of `revision` into the Hugging Face cache (or found there), as a later
        `vllm serve` or `hf download` would find it."""
        with hub_errors(f"Downloading {path} of {self.repo_id}", self.repo_id, self.endpoint):
            local = hf_hub_download(
                self.repo_id,
                path,
                revision=revision,
                endpoint=self.endpoint,
                token=self.token,
                tqdm_class=tqdm if self.progress else _Silent,
            )
        return Path(local)

    def download(self, commit: str, path: str, folder: Path, *, again: bool = False) -> Path:
        """`path` of `commit` into `folder` (huggingface_hub resumes a cut transfer there).
        `again` skips any copy the Hugging Face cache or `folder` already holds."""
        with hub_errors(f"Downloading {path} of {self.repo_id}", self.repo_id, self.endpoint):
            local = hf_hub_download(
                self.repo_id,
                path,
                revision=commit,
                local_dir=folder,
                endpoint=self.endpoint,
                token=self.token,
                force_download=again,
                tqdm_class=tqdm if self.progress else _Silent,
            )
        return Path(local)


def matches_file_id(path: Path, file_id: tuple[str, str]) -> bool:
    kind, expected = file_id
    if kind == "sha256":
        return sha256_file(path) == expected
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest() == expected


class _Silent(tqdm):
    """A progress bar that never shows (huggingface_hub passes vanilla tqdm its kwargs)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


@contextmanager
def hub_errors(
    action: str, repo_id: str, endpoint: str | None, *, write: bool = False
) -> Iterator[None]:
    """Turn the client's exceptions into one HubError that says what to do. Nothing the
    server wrote (its error text, its body) goes into the message: a hostile server could
    put escape codes or advice of its own on the user's screen. The status and the URL
    asked for are given, made printable and bounded; SHARDPREP_DEBUG=1 shows the rest."""
    where = endpoint or constants.ENDPOINT
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        yield
    except RepositoryNotFoundError as exc:
        raise HubError(
            f"{action} failed: {repo_id} is not on {where}, or it is private or gated and no "
            f"token with access was given. Check the name, or {login}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise HubError(
            f"{action} failed: {repo_id} has no such revision on {where}. "
            "Pass a branch, tag or commit id that exists (--revision)"
        ) from exc
    except RemoteEntryNotFoundError as exc:
        raise HubError(
            f"{action} failed: the file is missing from {repo_id} on {where} although its "
            f"{MANIFEST_NAME} lists it; the upload is incomplete. Publish it again with "
            f"`shardprep publish OUT {repo_id}`"
        ) from exc
    except Exception as exc:
        response = failed_response(exc)
        if response is not None:
            status = response.status_code
            if status in (401, 403):
                need = "write access" if write else "read access"
                raise HubError(
                    f"{action} failed: {where} refused the request ({status}); {login} with a "
                    f"token that has {need} to {repo_id}"
                ) from exc
            raise HubError(
                f"{action} failed: {where} answered {status} to {_request_line(response)}; "
                f"{_advice(status)} (SHARDPREP_DEBUG=1 shows the server's answer)"
            ) from exc
        if not is_connection_error(exc):
            raise
        raise HubError(
            f"{action} failed: cannot reach {where} ({type(exc).__name__}: "
            f"{printable(exc, 200)}). Check the network, HF_ENDPOINT or --endpoint; a stage "
            "fetched before works offline with HF_HUB_OFFLINE=1"
        ) from exc


class HttpAnswer(Protocol):
    """What is read of an HTTP error answer: its status (and, by name, its request)."""

    status_code: int


def failed_response(exc: BaseException) -> HttpAnswer | None:
    """The HTTP error answer behind `exc`, if any: the client's HfHubHTTPError carries it,
    and so does the exception it raises while reading a body it cannot decode (a
    UnicodeDecodeError whose context is the HTTP status error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int) and status >= 400:
            return response
        current = current.__cause__ or current.__context__
    return None


def _request_line(response: object) -> str:
    request = getattr(response, "request", None)
    method = getattr(request, "method", None)
    url = getattr(response, "url", None) or getattr(request, "url", "")
    return printable(f"{method} {url}" if method else url, 300)


def _advice(status: int) -> str:
    if status == 429:
        return "it is limiting requests: wait a few minutes and try again"
    if status >= 500:
        return (
            "the server failed; try again later, and check HF_ENDPOINT or --endpoint if it "
            "keeps failing"
        )
    return "check the repo id, the revision, the token and HF_ENDPOINT or --endpoint"
