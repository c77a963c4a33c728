"""The harness side of vllm_zygote.py: start a run of vllm_runner.py as a child of a
process that has imported vLLM already, behind the part of ``subprocess.Popen`` that
``vllm_env.run_python`` uses (``pid``, ``returncode``, ``communicate``).

A zygote serves the runs whose environment equals the one it was started with, but for
the variables its children set for themselves (``vllm_zygote.PER_RUN``); a run with other
differences (a Hub endpoint, a vLLM variable read at import) gets a zygote of its own, at
most ``KEEP`` of them alive. ``SHARDPREP_VLLM_ZYGOTE=0`` starts every run in a fresh
interpreter instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_zygote import PER_RUN, PER_RUN_PREFIXES

SUPPORT = Path(__file__).resolve().parent
ZYGOTE = SUPPORT / "vllm_zygote.py"
RUNNER = SUPPORT / "vllm_runner.py"
DISABLE_ENV = "SHARDPREP_VLLM_ZYGOTE"
KEEP = 2
START_TIMEOUT_S = 180.0

Key = frozenset[tuple[str, str]]
forked_runs = 0  # runs a zygote has forked in this process


class ZygoteRun:
    """One run forked by a zygote; its output goes to two files of its TMPDIR."""

    def __init__(self, zygote: Zygote, args: list[str], env: Mapping[str, str], cwd: Path):
        self.stdout_path = Path(env["TMPDIR"]) / "runner.stdout"
        self.stderr_path = Path(env["TMPDIR"]) / "runner.stderr"
        self.args = args
        self.returncode: int | None = None
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(str(zygote.path))
        self.stream = self.conn.makefile("rwb")
        request = {
            "argv": args[1:], "env": dict(env), "cwd": str(cwd),
            "stdout": str(self.stdout_path), "stderr": str(self.stderr_path),
        }  # fmt: skip
        self.stream.write(json.dumps(request).encode() + b"\n")
        self.stream.flush()
        answer = self._answer()
        if "error" in answer:
            self.stream.close()
            self.conn.close()
            raise RuntimeError(f"the vLLM zygote did not fork the run: {answer['error']}")
        self.pid = int(answer["pid"])
        global forked_runs
        forked_runs += 1

    def _answer(self) -> dict[str, Any]:
        line = self.stream.readline()
        if not line:
            return {"pid": -1, "returncode": -1}  # the zygote died
        return json.loads(line)

    def poll(self, timeout: float = 0.0) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self.conn], [], [], max(0.0, timeout))
            if ready:
                self.returncode = int(self._answer()["returncode"])
                self.stream.close()
                self.conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.poll(3600.0 * 24 if timeout is None else timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return read(self.stdout_path), read(self.stderr_path)


class Zygote:
    def __init__(self, python: str, env: Mapping[str, str]):
        self.dir = Path(tempfile.mkdtemp(prefix="shardprep-zygote-"))
        self.path = self.dir / "socket"
        base = dict(env) | {"OMP_NUM_THREADS": "1", "TMPDIR": str(self.dir)}
        self.log = self.dir / "zygote.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [python, str(ZYGOTE), str(self.path)],
                env=base, cwd=SUPPORT, stdout=subprocess.PIPE, stderr=log, text=True,
            )  # fmt: skip
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        if not ready or self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            tail = self.log.read_text(errors="replace")[-3000:]
            self.stop()
            raise RuntimeError(f"the vLLM zygote did not start:\n{tail}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_zygotes: dict[Key, Zygote] = {}


def _shared_part(env: Mapping[str, str]) -> Key:
    return frozenset(
        (name, value)
        for name, value in env.items()
        if name not in PER_RUN and not name.startswith(PER_RUN_PREFIXES)
    )


def start(python: str, args: list[str], env: Mapping[str, str], cwd: Path) -> ZygoteRun | None:
    """``python ARGS`` (vllm_runner.py, offline) forked by a zygote, or None where it must
    be a fresh interpreter (the server mode, which starts one anyway; zygotes disabled)."""
    if os.environ.get(DISABLE_ENV) == "0" or "--server" in args or args[0] != str(RUNNER):
        return None
    key = _shared_part(env)
    zygote = _zygotes.pop(key, None)
    if zygote is None or not zygote.alive():
        while len(_zygotes) >= KEEP:
            _zygotes.pop(next(iter(_zygotes))).stop()
        zygote = Zygote(python, {name: value for name, value in key})
    _zygotes[key] = zygote  # the most recently used last
    return ZygoteRun(zygote, args, env, cwd)


@atexit.register
def stop_all() -> None:
    while _zygotes:
        _zygotes.popitem()[1].stop()
