"""A process that has imported vLLM once and forks one child per run of vllm_runner.py.

Each run in a fresh interpreter imports vLLM, torch and transformers again, about 5 s of
the 10-20 s that a tiny model's run takes here. A child forked from this process starts
with those modules imported and then runs ``vllm_runner.py`` exactly as a fresh
interpreter would: its own session (its process group is what the harness kills), the
run's environment, working directory and output files, ``TMPDIR`` looked up again.

    python tests/support/vllm_zygote.py SOCKET

is started by ``tests/support/vllm_env.py`` with the environment that its runs share (only
the variables in ``PER_RUN`` may differ per run: the ones that vLLM, torch and the test
plugin read when a run starts, not at import). It prints ``ready`` once it listens on the
Unix socket SOCKET. A request is one JSON line ``{"argv", "env", "cwd", "stdout",
"stderr"}``; the answer is ``{"pid": N}`` once the child runs, then ``{"returncode": N}``
when it ends. It serves one run at a time and exits when its parent does.

Imported with ``OMP_NUM_THREADS=1``: OpenMP's thread pool does not survive a fork, so this
process never starts one; a child whose run asks for more threads (one rank alone) sets
them before it computes, as a fresh interpreter's default would have been. Before each fork
it checks that it runs one thread, as the kernel counts them: a child gets only the thread
that forks, and a lock another thread held stays locked in it forever. With more, it
answers ``{"error"}`` instead of forking.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "vllm_runner.py")
PER_RUN_PREFIXES = ("SHARDPREP_",)
PER_RUN = frozenset(
    {"TMPDIR", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_PP_LAYER_PARTITION"}
)


def preload() -> None:
    """What every run imports before its engine starts."""
    sys.path.insert(0, HERE)
    import torch  # noqa: F401
    import vllm_runner  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.v1.engine import core  # noqa: F401
    from vllm.v1.executor import multiproc_executor  # noqa: F401


def run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the run, then exit with its status (never returns)."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is the run's own
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        sys.argv = [RUNNER, *request["argv"]]
        runpy.run_path(RUNNER, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def thread_ids() -> set[int]:
    """The threads of this process as the kernel lists them: native ones too (OpenMP's, a
    library's), which Python's `threading` does not know of."""
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except FileNotFoundError:  # no /proc: the threads Python started
        return {t.native_id or 0 for t in threading.enumerate()}


def fork_refusal() -> str | None:
    """Why this process must not fork now, or None: it runs more than one thread."""
    count = len(thread_ids())
    if count == 1:
        return None
    names = ", ".join(sorted(t.name for t in threading.enumerate()))
    return (
        f"the vLLM zygote runs {count} threads (Python's: {names}) where a fork needs one: "
        "the child would get only the forking thread, and any lock another one held stays "
        "locked in it; start that thread in the child (vllm_zygote.run_child), not on import"
    )


def serve(conn: socket.socket, server: socket.socket) -> None:
    with conn, conn.makefile("rwb") as stream:
        line = stream.readline()
        if not line:
            return
        request = json.loads(line)
        refusal = fork_refusal()
        if refusal is not None:
            stream.write(json.dumps({"error": refusal}).encode() + b"\n")
            stream.flush()
            return
        pid = os.fork()
        if pid == 0:
            for handle in (stream, conn, server):
                handle.close()
            run_child(request)
        stream.write(json.dumps({"pid": pid}).encode() + b"\n")
        stream.flush()
        _, status = os.waitpid(pid, 0)
        stream.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        stream.flush()


def main(path: str) -> None:
    preload()
    parent = os.getppid()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        server.settimeout(1.0)
        print("ready", flush=True)
        while os.getppid() == parent:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            # A harness that went away has killed the child with its group.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                serve(conn, server)


if __name__ == "__main__":
    main(sys.argv[1])
