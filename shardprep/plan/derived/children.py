"""The child processes that derive (probe.py): started at the first request and kept for
the next ones, since importing vLLM costs seconds that every derivation would pay again.
A large derivation's ranks are shared among several children, one a core (up to
MAX_CHILDREN, or SHARDPREP_DERIVE_CHILDREN), each holding one rank's model at a time: a
flagship's ranks take seconds to a minute each, a tiny model's a fraction of the import.
One that failed has stopped; the next request starts another."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from typing import Any

from shardprep.errors import PlanError, printable

PARTITION = "VLLM_PP_LAYER_PARTITION"  # set by the child for each request
# What a child reads as it starts (the rest it reads from each request's environment).
AT_START = ("PYTHON", "LD_", "VLLM_", "TORCH", "CUDA")
MAX_CHILDREN = 4  # each holds vLLM and one rank's meta model: under 1 GB
# Placeholders fed to vLLM, over every rank, from which another child pays for itself
LARGE = 200_000
CHILDREN = "SHARDPREP_DERIVE_CHILDREN"


class _Child:
    """One deriving child: a request sent (`send`), its answer read (`receive`)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.started_in: dict[str, str] = {}
        atexit.register(self.close)

    def send(self, request: dict[str, Any]) -> None:
        environment = {
            k: v for k, v in request["env"].items() if k.startswith(AT_START) and k != PARTITION
        }
        if environment != self.started_in:  # a new PYTHONPATH, say: what it imports differs
            self.close()
        if self.process is None or self.process.poll() is not None:
            self.started_in = environment
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shardprep.plan.derived.probe"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=request["env"],
            )
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it stopped: `receive` says so

    def receive(self) -> dict[str, Any]:
        """The answer: {"vllm": its version}, or {"error": one line}."""
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:  # what vLLM prints there too, then the answer
            answer = json.loads(line) if line.startswith("{") else None
            if isinstance(answer, dict) and answer.keys() & {"vllm", "error"}:
                break
        else:
            answer = {}
        if "error" in answer:
            self.close()
            return {
                "error": f"cannot derive the layout from vLLM: {printable(answer['error'], 600)}"
            }
        if "vllm" not in answer:
            status = self.close()
            return {
                "error": f"deriving the layout from vLLM stopped (exit status {status}) before "
                "it finished; its messages are above"
            }
        return answer

    def close(self) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        if process.stdin is not None:
            process.stdin.close()
        return process.wait()


_CHILDREN: list[_Child] = []


def derive(request: dict[str, Any], ranks: list[list[int]]) -> str:
    """Each of `ranks` derived by one of the children, its record in the request's `out`
    folder; the vLLM release. What stopped one is one PlanError, once all have answered."""
    count = how_many(len(ranks), len(request["tensors"]))
    while len(_CHILDREN) < count:
        _CHILDREN.append(_Child())
    shares = [ranks[i::count] for i in range(count)]
    for i, (child, share) in enumerate(zip(_CHILDREN, shares, strict=False)):
        child.send({**request, "ranks": share, "progress": request["progress"] and i == 0})
    answers = [child.receive() for child in _CHILDREN[:count]]
    for answer in answers:
        if "error" in answer:
            raise PlanError(answer["error"])
    return str(answers[0]["vllm"])


def how_many(ranks: int, tensors: int) -> int:
    """Children for `ranks` ranks fed `tensors` placeholders each: one a core, where the
    derivation is large enough to pay for their imports of vLLM."""
    wanted = os.environ.get(CHILDREN, "")
    if wanted.isdigit() and int(wanted) > 0:
        return min(int(wanted), ranks)
    if ranks * tensors < LARGE:
        return 1
    return max(1, min(ranks, os.cpu_count() or 1, MAX_CHILDREN))


def stop() -> None:
    """Stop every child now (the next derivation starts others)."""
    for child in _CHILDREN:
        child.close()
