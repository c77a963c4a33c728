"""vLLM modules built in gloo processes, without an engine: for drafts the CPU engine
refuses at start-up, whose own modules still build and load on the CPU."""

from __future__ import annotations

import json
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import vllm_env

TIMEOUT_S = 420.0


@dataclass(frozen=True)
class Worker:
    name: str  # its log's name
    args: tuple[str, ...]  # after the script's path
    group: str  # the workers of one group share a dist ident (and a port in `args`)


def dist_ident() -> str:
    """A new VLLM_DIST_IDENT: vLLM's CPU communicators name their shared memory after it."""
    return f"vllm_dist_{uuid.uuid4().hex}"


def run_workers(
    script: str, workers: Sequence[Worker], result_prefix: str, extra: Mapping[str, str]
) -> list[dict]:
    """Run `script` once per worker, one vLLM run at a time on this machine, and return
    the JSON each printed after `result_prefix`; fail with the logs' tails unless every
    worker exits 0. Each group's shared-memory files are removed afterwards."""
    logs = Path(tempfile.mkdtemp(prefix="gloo-workers-"))
    idents = {worker.group: dist_ident() for worker in workers}
    procs = []
    with vllm_env.one_vllm_at_a_time():
        for worker in workers:
            tmp = logs / f"tmp-{worker.name}"
            tmp.mkdir()
            env = vllm_env.vllm_environ(
                1, tmp, {"OMP_NUM_THREADS": "1", "VLLM_DIST_IDENT": idents[worker.group], **extra}
            )
            cmd = [vllm_env.require_python(), script, *worker.args]
            with open(logs / f"{worker.name}.log", "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        try:
            codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            vllm_env.remove_dist_files(logs / "dist", " ".join(idents.values()))
    outputs = [path.read_text() for path in sorted(logs.glob("*.log"))]
    assert codes == [0] * len(workers), "\n".join(out[-3000:] for out in outputs)
    lines = [line for out in outputs for line in out.splitlines()]
    return [
        json.loads(line.removeprefix(result_prefix))
        for line in lines
        if line.startswith(result_prefix)
    ]
