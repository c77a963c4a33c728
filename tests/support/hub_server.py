"""A local stand-in for the Hugging Face Hub, for tests that drive the real huggingface_hub client.

Standard library only. It speaks the subset of the Hub's HTTP protocol that `HfApi.create_repo`,
`HfApi.upload_folder` (LFS path: the client needs `HF_HUB_DISABLE_XET`), `snapshot_download`,
`hf_hub_download`, `HfApi.list_repo_files` / `list_repo_tree` / `get_paths_info` /
`model_info` / `repo_info` / `file_exists` and `HfApi.verify_repo_checksums` use, with the
headers and JSON bodies those functions read (checked against huggingface_hub 2.4.0's source).

    with HubServer(tmp_path / "hub") as hub:
        HfApi(endpoint=hub.endpoint).create_repo("org/model")

Storage (under `storage_dir`, so a new server on the same folder sees the same repos):
`blobs/<sha256>` holds each content once; `repos/<org>/<name>/commits/<id>.json` maps every path
of a revision to its blob; `refs/<branch>` holds the branch head. Commit ids are 40-hex sha1s.
Model repos only; repo ids are "org/name"; revisions are branch names or full commit ids.

Test hooks: `corrupt_blob`, `cut_next_download`, `stall_next_download`, `downloads`,
`download_ranges`, `bytes_served`, `requests`, `downloads_by_origin`; hostile answers:
`serve_other_after_download`, `answer_header_reads_with`, `fail_requests`.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import functools
import hashlib
import json
import os
import re
import socket
import threading
import time
import traceback
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode

# Files the Hub's default `.gitattributes` sends to LFS. Larger or binary files go to LFS too.
LFS_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.npy",
    "*.npz",
    "*.gguf",
    "*.pkl",
    "*.zst",
    "*.gz",
    "*.tar",
    "*.zip",
)
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS)
IO_CHUNK = 1024 * 1024
STALL_LIMIT_S = 120.0  # the longest a stalled download waits for its release

_COMMIT_ID = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RANGE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*")

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_REV = r"(?P<rev>[^/]+)"
_PATH = r"(?P<path>.+)"

# (HTTP method, path regex matched against the raw request path, HubServer handler method)
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", r"/api/repos/create", "_create_repo"),
    ("POST", r"/api/validate-yaml", "_validate_yaml"),
    ("GET", rf"/api/models/{_REPO}", "_repo_info"),
    ("GET", rf"/api/models/{_REPO}/revision/{_REV}", "_repo_info"),
    ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/{_PATH})?", "_tree"),
    ("POST", rf"/api/models/{_REPO}/paths-info/{_REV}", "_paths_info"),
    ("POST", rf"/api/models/{_REPO}/preupload/{_REV}", "_preupload"),
    ("POST", rf"/api/models/{_REPO}/commit/{_REV}", "_commit"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "_lfs_batch"),
    ("PUT", r"/lfs/objects/(?P<oid>[0-9a-f]{64})", "_lfs_put"),
    ("POST", rf"/{_REPO}\.git/info/lfs/objects/verify", "_lfs_verify"),
    ("HEAD", rf"/{_REPO}/resolve/{_REV}/{_PATH}", "_resolve"),
    ("GET", rf"/{_REPO}/resolve/{_REV}/{_PATH}", "_resolve"),
)
_COMPILED_ROUTES = tuple((m, re.compile(p), h) for m, p, h in ROUTES)


# ---------------------------------------------------------------------------------------------
# Data model


@dataclass(frozen=True)
class FileEntry:
    """One file of a revision. `oid` is the git blob id (of the LFS pointer for LFS files)."""

    sha256: str
    size: int
    lfs: bool
    oid: str

    @property
    def etag(self) -> str:
        """What the Hub sends as ETag: the sha256 for LFS files, the git blob sha1 otherwise."""
        return self.sha256 if self.lfs else self.oid


@dataclass(frozen=True)
class Commit:
    id: str
    parent: str | None
    summary: str
    description: str
    date: str
    files: dict[str, FileEntry]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Commit:
        raw = json.loads(data)
        files = {path: FileEntry(**entry) for path, entry in raw.pop("files").items()}
        return cls(files=files, **raw)


class HubError(Exception):
    """An error answered the way the Hub answers it: status, `X-Error-Code`, JSON `error`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}

    def response(self) -> _Response:
        safe = self.message.encode("ascii", "backslashreplace").decode()
        headers = {"X-Error-Message": " ".join(safe.split()), **self.headers}
        if self.code is not None:
            headers["X-Error-Code"] = self.code
        return _json({"error": self.message}, self.status, headers)


def _repo_not_found(repo_id: str) -> HubError:
    return HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")


def _entry_not_found(path: str, commit_id: str) -> HubError:
    message = f"Entry not found: {path} (a file with this name doesn't exist)"
    return HubError(404, message, "EntryNotFound", {"X-Repo-Commit": commit_id})


# ---------------------------------------------------------------------------------------------
# Small helpers


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )


def _lfs_entry(sha256: str, size: int) -> FileEntry:
    return FileEntry(
        sha256=sha256, size=size, lfs=True, oid=git_blob_oid(lfs_pointer(sha256, size))
    )


def _regular_entry(data: bytes) -> FileEntry:
    sha256 = hashlib.sha256(data).hexdigest()
    return FileEntry(sha256=sha256, size=len(data), lfs=False, oid=git_blob_oid(data))


def wants_lfs(path: str, size: int, sample: bytes) -> bool:
    """The Hub's upload-mode rule: LFS by `.gitattributes` pattern, by size, or for binary data."""
    name = PurePosixPath(path).name
    matched = any(fnmatch.fnmatch(name, pattern) for pattern in LFS_PATTERNS)
    return matched or size >= LFS_MIN_SIZE or b"\0" in sample


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _closed_range(request: _Request) -> bool:
    """Whether the request asks for a range with an end (`bytes=A-B`)."""
    match = _RANGE.fullmatch(request.headers.get("Range") or "")
    return match is not None and match.group(2) != ""


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single `Range: bytes=...` request; None to send the whole file."""
    match = _RANGE.fullmatch(header) if header else None
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":
        start, end = max(size - int(last), 0), size - 1
    else:
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise HubError(
            416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{size}"}
        )
    return start, end


# ---------------------------------------------------------------------------------------------
# On-disk repositories


class _Store:
    """Content-addressed blobs plus per-revision file trees, all on disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.RLock()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "repos").mkdir(parents=True, exist_ok=True)

    def blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def has_blob(self, sha256: str, size: int | None = None) -> bool:
        path = self.blob_path(sha256)
        return path.is_file() and (size is None or path.stat().st_size == size)

    def put_blob(self, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha256, len(data)):
            _write_atomic(self.blob_path(sha256), data)
        return sha256

    def _repo_dir(self, repo_id: str) -> Path:
        return self.root / "repos" / repo_id

    def repo_meta(self, repo_id: str) -> dict[str, Any]:
        meta = self._repo_dir(repo_id) / "repo.json"
        if "/" not in repo_id or ".." in repo_id.split("/") or not meta.is_file():
            raise _repo_not_found(repo_id)
        return json.loads(meta.read_bytes())

    def create(self, repo_id: str, private: bool) -> bool:
        """Create the repo with an initial `.gitattributes` commit; False if it already exists."""
        with self.lock:
            meta = self._repo_dir(repo_id) / "repo.json"
            if meta.is_file():
                return False
            _write_atomic(meta, json.dumps({"private": private, "createdAt": _now()}).encode())
            data = GITATTRIBUTES.encode()
            self.put_blob(data)
            files = {".gitattributes": _regular_entry(data)}
            self.write_commit(repo_id, "main", None, "initial commit", "", files)
            return True

    def branch_head(self, repo_id: str, branch: str) -> str | None:
        ref = self._repo_dir(repo_id) / "refs" / branch
        if "/" in branch or branch.startswith(".") or not ref.is_file():
            return None
        return ref.read_text().strip()

    def load_commit(self, repo_id: str, commit_id: str) -> Commit | None:
        path = self._repo_dir(repo_id) / "commits" / f"{commit_id}.json"
        return Commit.from_json(path.read_bytes()) if path.is_file() else None

    def resolve(self, repo_id: str, rev: str) -> Commit:
        self.repo_meta(repo_id)
        commit_id = self.branch_head(repo_id, rev) or (rev if _COMMIT_ID.fullmatch(rev) else None)
        commit = self.load_commit(repo_id, commit_id) if commit_id else None
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    def write_commit(
        self,
        repo_id: str,
        branch: str,
        parent: str | None,
        summary: str,
        description: str,
        files: dict[str, FileEntry],
    ) -> Commit:
        date = _now()
        identity = {"repo": repo_id, "parent": parent, "summary": summary, "date": date}
        identity["files"] = {path: asdict(entry) for path, entry in sorted(files.items())}
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        commit = Commit(digest, parent, summary, description, date, dict(sorted(files.items())))
        repo_dir = self._repo_dir(repo_id)
        _write_atomic(repo_dir / "commits" / f"{commit.id}.json", commit.to_json())
        _write_atomic(repo_dir / "refs" / branch, commit.id.encode())
        return commit


# ---------------------------------------------------------------------------------------------
# HTTP plumbing


@dataclass
class _Request:
    method: str
    path: str
    query: dict[str, str]
    headers: Message
    body: bytes
    args: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except json.JSONDecodeError as err:
            raise HubError(400, f"Invalid JSON body: {err}") from err


@dataclass(frozen=True)
class _FileSlice:
    path: Path
    start: int
    length: int
    cut_after: int | None = None
    count_as: tuple[str, str] | None = None  # (repo, path) whose served bytes this adds to
    stall: threading.Event | None = None  # after `cut_after` bytes, wait for it, then hang up


@dataclass
class _Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    file: _FileSlice | None = None


def _json(
    payload: Any,
    status: int = 200,
    headers: dict[str, str] | None = None,
    content_type: str = "application/json; charset=utf-8",
) -> _Response:
    body = json.dumps(payload).encode()
    return _Response(status, body, {"Content-Type": content_type, **(headers or {})})


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: HubServer) -> None:
        self.hub = hub
        self.connections: set[socket.socket] = set()
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Close idle keep-alive connections so their handler threads end with the server."""
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate sends: avoid 40 ms stalls
    server: _HTTPServer

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr line; `HubServer.requests` is the log."""

    def _dispatch(self) -> None:
        try:
            response = self.server.hub._handle(self._read_request())
        except HubError as err:
            response = err.response()
        except Exception as err:  # a bug in this server: show it, answer 500
            traceback.print_exc()
            response = HubError(500, f"Test Hub server error: {err!r}").response()
        self._send(response)

    def _read_request(self) -> _Request:
        path, _, query = self.path.partition("?")
        params = {
            key: values[-1] for key, values in parse_qs(query, keep_blank_values=True).items()
        }
        return _Request(self.command, path, params, self.headers, self._read_body())

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _read_chunked(self) -> bytes:
        parts = []
        while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
            parts.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass  # trailers
        return b"".join(parts)

    def _send(self, response: _Response) -> None:
        length = response.file.length if response.file else len(response.body)
        self.send_response(response.status)
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command == "HEAD":
            return
        if response.file is None:
            self.wfile.write(response.body)
        else:
            self._send_file(response.file)

    def _send_file(self, part: _FileSlice) -> None:
        remaining = part.length if part.cut_after is None else min(part.cut_after, part.length)
        with part.path.open("rb") as blob:
            blob.seek(part.start)
            while remaining > 0:
                chunk = blob.read(min(IO_CHUNK, remaining))
                # Counted before it is written: a client that has read it sees the count.
                if part.count_as is not None:
                    self.server.hub._count_served(part.count_as, len(chunk))
                self.wfile.write(chunk)
                remaining -= len(chunk)
        if part.cut_after is not None:
            self.wfile.flush()
            if part.stall is not None:
                part.stall.wait(STALL_LIMIT_S)
            self.close_connection = True  # the advertised Content-Length is never reached


# ---------------------------------------------------------------------------------------------
# The server


class HubServer:
    """A Hub-compatible HTTP server on 127.0.0.1 (free port), serving in a daemon thread."""

    def __init__(
        self,
        storage_dir: Path | str,
        *,
        tree_page_size: int = 1000,
        ignore_ranges: bool = False,
        bandwidth: float | None = None,
    ) -> None:
        """`ignore_ranges`: answer every GET with the whole file (200), as a server that
        does not support range requests does. `bandwidth`: bytes per second that every
        file body sent, all connections together, is held to (for benchmarks)."""
        self._store = _Store(Path(storage_dir))
        self._tree_page_size = tree_page_size
        self._ignore_ranges = ignore_ranges
        self._bandwidth = bandwidth
        self._sent_until = 0.0  # when the bytes sent so far may have been sent, at `bandwidth`
        self._lock = threading.Lock()
        self._requests: list[tuple[str, str]] = []
        self._origins: list[tuple[str, str, str | None]] = []
        self._ranges: dict[tuple[str, str], list[str | None]] = defaultdict(list)
        self._cuts: dict[tuple[str, str], tuple[int, threading.Event | None]] = {}
        self._served: dict[tuple[str, str], int] = defaultdict(int)
        self._stalls: list[threading.Event] = []
        # Hostile answers, by (repo, path): see the methods that arm them.
        self._after_download: dict[tuple[str, str], tuple[FileEntry, bool]] = {}
        self._header_reads: dict[tuple[str, str], str] = {}
        self._failing: dict[tuple[str, str], int] = {}
        self._http: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> HubServer:
        self._http = _HTTPServer(self)
        serve = functools.partial(self._http.serve_forever, poll_interval=0.05)
        self._thread = threading.Thread(target=serve, name="hub-server")
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._http is None:
            return
        for stall in self._stalls:
            stall.set()
        self._http.shutdown()
        self._http.drop_connections()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http = self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        if self._http is None:
            raise RuntimeError(
                "HubServer is not running: use it as a context manager or call start()"
            )
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    # -- test hooks -----------------------------------------------------------------------------

    @property
    def requests(self) -> list[tuple[str, str]]:
        """Every request so far as (method, percent-decoded path without query), in order."""
        with self._lock:
            return list(self._requests)

    def downloads_by_origin(self, repo_id: str) -> dict[str | None, list[str]]:
        """Repo paths of the GETs of `/resolve/` of this repo, per the `origin/NAME` part of
        the client's User-Agent (huggingface_hub's HF_HUB_USER_AGENT_ORIGIN; None without)."""
        prefix = f"/{repo_id}/resolve/"
        found: dict[str | None, list[str]] = defaultdict(list)
        with self._lock:
            for method, path, origin in self._origins:
                if method == "GET" and path.startswith(prefix):
                    found[origin].append(path[len(prefix) :].split("/", 1)[1])
        return dict(found)

    def downloads(self, repo_id: str, path: str) -> int:
        """Number of GETs of `/resolve/` for this file (any revision; HEADs not counted)."""
        return len(self.download_ranges(repo_id, path))

    def download_ranges(self, repo_id: str, path: str) -> list[str | None]:
        """The `Range` header of each GET of this file, None where the client sent none."""
        with self._lock:
            return list(self._ranges.get((repo_id, path), []))

    def bytes_served(self, repo_id: str, path: str) -> int:
        """Body bytes sent for this file by GETs of `/resolve/` so far (any revision)."""
        with self._lock:
            return self._served.get((repo_id, path), 0)

    def _count_served(self, key: tuple[str, str], count: int) -> None:
        with self._lock:
            self._served[key] += count
            if self._bandwidth is None:
                return
            self._sent_until = max(self._sent_until, time.monotonic()) + count / self._bandwidth
            until = self._sent_until
        time.sleep(max(0.0, until - time.monotonic()))

    def cut_next_download(self, repo_id: str, path: str, after_bytes: int) -> None:
        """The next GET of this file asking for more than `after_bytes` bytes sends
        `after_bytes` bytes of its body, then hangs up."""
        with self._lock:
            self._cuts[(repo_id, path)] = (after_bytes, None)

    def stall_next_download(self, repo_id: str, path: str, after_bytes: int) -> threading.Event:
        """Like `cut_next_download`, but after `after_bytes` bytes the connection stays open,
        sending nothing, until the event returned is set (or STALL_LIMIT_S pass); then the
        server hangs up. A client killed meanwhile has received exactly those bytes."""
        stall = threading.Event()
        with self._lock:
            self._cuts[(repo_id, path)] = (after_bytes, stall)
            self._stalls.append(stall)
        return stall

    def corrupt_blob(self, repo_id: str, path: str, revision: str = "main") -> None:
        """Flip one byte (the middle one) of the stored content of this file, in place.

        Size, sha256, ETag and tree metadata stay as advertised. The blob is content-addressed,
        so every file and revision that shares these bytes serves the corrupted copy too.
        """
        entry = self._store.resolve(repo_id, revision).files.get(path)
        if entry is None or entry.size == 0:
            raise ValueError(f"{repo_id}@{revision} has no non-empty file {path!r} to corrupt")
        with self._store.blob_path(entry.sha256).open("r+b") as blob:
            blob.seek(entry.size // 2)
            byte = blob.read(1)
            blob.seek(entry.size // 2)
            blob.write(bytes([byte[0] ^ 0xFF]))

    def serve_other_after_download(self, repo_id: str, path: str, data: bytes) -> None:
        """Once a GET has been sent the whole body of this file, every later HEAD and GET
        of it names `data` (its sha256 as ETag, its size) and sends it instead, while the
        tree listing still states the real file: a server that changes its answer when
        asked again."""
        with self._lock:
            self._after_download[(repo_id, path)] = (
                _lfs_entry(self._store.put_blob(data), len(data)),
                False,
            )

    def answer_header_reads_with(self, repo_id: str, path: str, data: bytes) -> None:
        """Range reads with an end (`bytes=A-B`, as a header is read) of this file are
        answered from `data`, of the file's length, instead; a GET of the whole file, or
        from an offset to its end, gets the real bytes."""
        with self._lock:
            self._header_reads[(repo_id, path)] = self._store.put_blob(data)

    def fail_requests(self, repo_id: str, path: str, status: int = 503) -> None:
        """Every HEAD and GET of this file is answered `status`, with `Retry-After: 0`
        (so that a client retries at once)."""
        with self._lock:
            self._failing[(repo_id, path)] = status

    def head(self, repo_id: str, branch: str = "main") -> str:
        """Commit id of the branch head."""
        return self._store.resolve(repo_id, branch).id

    # -- dispatch -------------------------------------------------------------------------------

    def _handle(self, request: _Request) -> _Response:
        agent = request.headers.get("User-Agent") or ""
        origin = next((p[7:] for p in agent.split("; ") if p.startswith("origin/")), None)
        with self._lock:
            self._requests.append((request.method, unquote(request.path)))
            self._origins.append((request.method, unquote(request.path), origin))
        for method, pattern, handler in _COMPILED_ROUTES:
            match = pattern.fullmatch(request.path)
            if match and method == request.method:
                groups = match.groupdict().items()
                request.args = {key: unquote(value) for key, value in groups if value is not None}
                return getattr(self, handler)(request)
        raise HubError(404, f"Not found: {request.method} {request.path}")

    # -- repos ----------------------------------------------------------------------------------

    def _create_repo(self, request: _Request) -> _Response:
        payload = request.json()
        if payload.get("type", "model") != "model":
            raise HubError(400, "This test Hub only hosts model repos")
        org, name = payload.get("organization"), payload.get("name")
        if not org or not name or "/" in name:
            raise HubError(400, f"Repo ids must look like 'org/name', got {org}/{name}")
        repo_id = f"{org}/{name}"
        url = f"{self.endpoint}/{repo_id}"
        private = payload.get("visibility") == "private" or payload.get("private") is True
        if not self._store.create(repo_id, private):
            return _json({"error": "You already created this model repo", "url": url}, 409)
        return _json({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self, request: _Request) -> _Response:
        return _json({"errors": [], "warnings": []})

    def _repo_info(self, request: _Request) -> _Response:
        repo_id = request.args["repo"]
        meta = self._store.repo_meta(repo_id)
        commit = self._store.resolve(repo_id, request.args.get("rev", "main"))
        blobs = request.query.get("blobs", "").lower() == "true"
        siblings = [_sibling(path, entry, blobs) for path, entry in commit.files.items()]
        return _json(
            {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit.id,
                "lastModified": commit.date,
                "createdAt": meta["createdAt"],
                "private": meta["private"],
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "spaces": [],
                "usedStorage": sum(entry.size for entry in commit.files.values()),
            }
        )

    def _tree(self, request: _Request) -> _Response:
        commit = self._store.resolve(request.args["repo"], request.args["rev"])
        base = request.args.get("path", "").strip("/")
        recursive = request.query.get("recursive", "").lower() in ("true", "1")
        entries = _listing(commit, base, recursive)
        start = int(request.query.get("cursor") or 0)
        stop = start + self._tree_page_size
        headers = {}
        if stop < len(entries):
            query = urlencode({**request.query, "cursor": stop})
            headers["Link"] = f'<{self.endpoint}{request.path}?{query}>; rel="next"'
        return _json(entries[start:stop], headers=headers)

    def _paths_info(self, request: _Request) -> _Response:
        commit = self._store.resolve(request.args["repo"], request.args["rev"])
        form = parse_qs(request.body.decode(), keep_blank_values=True)
        directories = {parent for path in commit.files for parent in _parents(path)}
        found = []
        for path in (p.strip("/") for p in form.get("paths", [])):
            if path in commit.files:
                found.append(_file_info(path, commit.files[path]))
            elif path in directories:
                found.append(_folder_info(path, commit))
        return _json(found)

    # -- uploads --------------------------------------------------------------------------------

    def _preupload(self, request: _Request) -> _Response:
        commit = self._store.resolve(request.args["repo"], request.args["rev"])
        files = [_upload_mode(item, commit) for item in request.json().get("files", [])]
        return _json({"files": files, "commitOid": commit.id})

    def _commit(self, request: _Request) -> _Response:
        repo_id, branch = request.args["repo"], request.args["rev"]
        if request.query.get("create_pr"):
            raise HubError(400, "Pull requests are not supported by the test Hub")
        lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "A commit payload starts with a 'header' line")
        header = lines[0]["value"]
        with self._store.lock:
            head = self._branch_head(repo_id, branch, header.get("parentCommit"))
            files = dict(head.files)
            for operation in lines[1:]:
                self._apply(operation, files, head.id)
            commit = self._store.write_commit(
                repo_id,
                branch,
                head.id,
                header.get("summary", ""),
                header.get("description", ""),
                files,
            )
        return _json(
            {
                "success": True,
                "commitOid": commit.id,
                "commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit.id}",
                "commitMessage": commit.summary,
                "hookOutput": "",
                "pullRequestUrl": None,
            }
        )

    def _branch_head(self, repo_id: str, branch: str, parent_commit: str | None) -> Commit:
        self._store.repo_meta(repo_id)
        head_id = self._store.branch_head(repo_id, branch)
        if head_id is None:
            raise HubError(
                404, f"Invalid rev id: {branch} (commits go to a branch)", "RevisionNotFound"
            )
        if parent_commit and not head_id.startswith(parent_commit):
            raise HubError(
                412, f"A commit has happened since {parent_commit}: {branch} is at {head_id}"
            )
        return self._store.resolve(repo_id, head_id)

    def _apply(self, operation: dict[str, Any], files: dict[str, FileEntry], head_id: str) -> None:
        key, value = operation.get("key"), operation.get("value", {})
        path = str(value.get("path", "")).strip()
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise HubError(400, f"Invalid path in repo: {path!r}")
        if key == "file":
            data = base64.b64decode(value["content"])
            self._store.put_blob(data)
            files[path] = _regular_entry(data)
        elif key == "lfsFile":
            oid, size = value.get("oid", ""), value.get("size")
            if not self._store.has_blob(oid, size):
                raise HubError(400, f"LFS object {oid} ({path}) was not uploaded; upload it first")
            files[path] = _lfs_entry(oid, self._store.blob_path(oid).stat().st_size)
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise _entry_not_found(path, head_id)
        elif key == "deletedFolder":
            prefix = path.rstrip("/") + "/"
            doomed = [p for p in files if p.startswith(prefix)]
            if not doomed:
                raise _entry_not_found(path, head_id)
            for doomed_path in doomed:
                del files[doomed_path]
        else:
            raise HubError(400, f"Unknown commit operation {key!r}")

    def _lfs_batch(self, request: _Request) -> _Response:
        repo_id = request.args["repo"]
        self._store.repo_meta(repo_id)
        payload = request.json()
        if payload.get("operation") != "upload":
            raise HubError(400, "This test Hub serves downloads through /resolve/ only")
        objects = [self._batch_object(repo_id, item) for item in payload.get("objects", [])]
        batch = {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}
        return _json(batch, content_type="application/vnd.git-lfs+json")

    def _batch_object(self, repo_id: str, item: dict[str, Any]) -> dict[str, Any]:
        oid, size = str(item.get("oid", "")), item.get("size")
        if not _SHA256.fullmatch(oid) or not isinstance(size, int):
            return {
                "oid": oid,
                "size": size or 0,
                "error": {"code": 422, "message": "Bad oid/size"},
            }
        if self._store.has_blob(oid, size):
            return {"oid": oid, "size": size}  # already stored: no actions, the client skips it
        verify = f"{self.endpoint}/{repo_id}.git/info/lfs/objects/verify"
        actions = {
            "upload": {"href": f"{self.endpoint}/lfs/objects/{oid}", "expires_in": 3600},
            "verify": {"href": verify, "header": {}, "expires_in": 3600},
        }
        return {"oid": oid, "size": size, "authenticated": True, "actions": actions}

    def _lfs_put(self, request: _Request) -> _Response:
        oid = request.args["oid"]
        found = hashlib.sha256(request.body).hexdigest()
        if found != oid:
            raise HubError(400, f"Uploaded bytes hash to {found}, not to {oid}")
        self._store.put_blob(request.body)
        return _Response(headers={"ETag": f'"{hashlib.md5(request.body).hexdigest()}"'})

    def _lfs_verify(self, request: _Request) -> _Response:
        self._store.repo_meta(request.args["repo"])
        payload = request.json()
        if not self._store.has_blob(str(payload.get("oid", "")), payload.get("size")):
            raise HubError(
                404, f"LFS object {payload.get('oid')} of size {payload.get('size')} not found"
            )
        return _json({"success": True})

    # -- downloads ------------------------------------------------------------------------------

    def _resolve(self, request: _Request) -> _Response:
        repo_id, path = request.args["repo"], request.args["path"]
        commit = self._store.resolve(repo_id, request.args["rev"])
        entry = commit.files.get(path)
        if entry is None:
            raise _entry_not_found(path, commit.id)
        key = (repo_id, path)
        with self._lock:
            failing = self._failing.get(key)
            other, served = self._after_download.get(key, (None, False))
            header_reads = self._header_reads.get(key)
        if failing is not None:
            raise HubError(failing, "Service unavailable", headers={"Retry-After": "0"})
        if other is not None and served:
            entry = other
        headers = _file_headers(commit.id, entry)
        blob = self._store.blob_path(entry.sha256)
        if request.method == "HEAD":
            return _Response(headers=headers, file=_FileSlice(blob, 0, entry.size))
        byte_range = (
            None if self._ignore_ranges else _byte_range(request.headers.get("Range"), entry.size)
        )
        if other is not None and byte_range is None:
            with self._lock:
                self._after_download[key] = (other, True)
        if header_reads is not None and byte_range is not None and _closed_range(request):
            blob = self._store.blob_path(header_reads)
        length = entry.size if byte_range is None else byte_range[1] - byte_range[0] + 1
        cut_after, stall = self._note_download(repo_id, path, request.headers.get("Range"), length)
        if byte_range is None:
            body = _FileSlice(blob, 0, entry.size, cut_after, key, stall)
            return _Response(headers=headers, file=body)
        start, end = byte_range
        headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        body = _FileSlice(blob, start, end - start + 1, cut_after, key, stall)
        return _Response(206, headers=headers, file=body)

    def _note_download(
        self, repo_id: str, path: str, range_header: str | None, length: int
    ) -> tuple[int | None, threading.Event | None]:
        """Count this GET; return the byte count to cut it after (and the event a stall
        waits for), if a cut was armed for a GET longer than that (a short range read, e.g.
        of a header, leaves it armed)."""
        with self._lock:
            self._ranges[(repo_id, path)].append(range_header)
            cut = self._cuts.get((repo_id, path))
            if cut is None or length <= cut[0]:
                return None, None
            return self._cuts.pop((repo_id, path))


# ---------------------------------------------------------------------------------------------
# JSON shapes (as huggingface_hub's RepoFile / RepoFolder / RepoSibling parse them)


def _lfs_info(entry: FileEntry) -> dict[str, Any]:
    pointer_size = len(lfs_pointer(entry.sha256, entry.size))
    return {"oid": entry.sha256, "size": entry.size, "pointerSize": pointer_size}


def _file_info(path: str, entry: FileEntry) -> dict[str, Any]:
    info: dict[str, Any] = {"type": "file", "oid": entry.oid, "size": entry.size, "path": path}
    if entry.lfs:
        info["lfs"] = _lfs_info(entry)
    return info


def _folder_info(path: str, commit: Commit) -> dict[str, Any]:
    prefix = f"{path}/"
    content = sorted((p, e.oid) for p, e in commit.files.items() if p.startswith(prefix))
    oid = hashlib.sha1(json.dumps(content).encode()).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


def _sibling(path: str, entry: FileEntry, blobs: bool) -> dict[str, Any]:
    if not blobs:
        return {"rfilename": path}
    sibling: dict[str, Any] = {"rfilename": path, "size": entry.size, "blobId": entry.oid}
    if entry.lfs:
        lfs = _lfs_info(entry)
        sibling["lfs"] = {
            "size": entry.size,
            "sha256": entry.sha256,
            "pointerSize": lfs["pointerSize"],
        }
    return sibling


def _listing(commit: Commit, base: str, recursive: bool) -> list[dict[str, Any]]:
    """Tree entries under `base` (children only, or all descendants when `recursive`)."""
    directories = {parent for path in commit.files for parent in _parents(path)}
    if base and base not in directories:
        raise _entry_not_found(base, commit.id)
    prefix = f"{base}/" if base else ""

    def wanted(path: str) -> bool:
        return path.startswith(prefix) and (recursive or "/" not in path[len(prefix) :])

    folders = [_folder_info(path, commit) for path in directories if wanted(path)]
    files = [_file_info(path, entry) for path, entry in commit.files.items() if wanted(path)]
    return sorted(folders + files, key=lambda info: info["path"])


def _upload_mode(item: dict[str, Any], commit: Commit) -> dict[str, Any]:
    path, size = str(item.get("path", "")), int(item.get("size", 0))
    lfs = wants_lfs(path, size, base64.b64decode(item.get("sample", "")))
    existing = commit.files.get(path)
    oid = None if existing is None else existing.sha256 if existing.lfs else existing.oid
    mode = "lfs" if lfs else "regular"
    return {"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid}


def _file_headers(commit_id: str, entry: FileEntry) -> dict[str, str]:
    headers = {
        "Content-Type": "application/octet-stream",
        "Accept-Ranges": "bytes",
        "ETag": f'"{entry.etag}"',
        "X-Repo-Commit": commit_id,
    }
    if entry.lfs:
        headers["X-Linked-Etag"] = f'"{entry.sha256}"'
        headers["X-Linked-Size"] = str(entry.size)
    return headers
