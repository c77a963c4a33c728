"""Pytest-side helper: run a real vLLM (CPU build) in a subprocess through vllm_runner.py.

    generate(model_dir, tp, pp, load_format="auto", **kw) -> list[list[int]]
    dump_state(model_dir, tp, pp, dump_dir, **kw) -> {(role, pp_rank, tp_rank): Path}
    serve_and_complete(model_dir, tp, pp, load_format, prompt_ids, **kw) -> list[int]
    run_until(done, model_dir, tp, pp, load_format, **kw) -> None (stopped once done())
    with_torchvision(env) -> env for a run whose model class imports torchvision

Keyword arguments of the first three: prompts (list of token-id lists), max_tokens,
dtype ("float32" unless given), speculative_config (dict), model_loader_extra_config
(dict), enforce_eager (also at tp or pp > 1), engine (more vllm.LLM arguments, e.g.
enable_expert_parallel), env (extra environment, e.g. VLLM_PP_LAYER_PARTITION), timeout
(seconds); generate also takes dump_dir, dump_state
also allow_engine_failure. read_dump(path) -> (tensors, metadata) reads one dump file.

The vLLM python is ``$SHARDPREP_VLLM_PYTHON``, else this interpreter if it has vLLM,
else ``<repo>/.venv-vllm/bin/python``. One vLLM runs at a time (a file lock), and the
``vllm_dist_*`` files of each run are removed afterwards. An offline run is forked from a
process that has imported vLLM once (zygote_client.py); ``SHARDPREP_VLLM_ZYGOTE=0`` starts
each in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import zygote_client

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
RUNNER = SUPPORT / "vllm_runner.py"
PYTHON_ENV = "SHARDPREP_VLLM_PYTHON"
DUMP_DIR_ENV = "SHARDPREP_DUMP_DIR"
DUMP_FORMAT = "dump-default"
DUMP_PLUGIN = "shardprep_test_dump"
DEFAULT_TIMEOUT = 600.0
DEFAULT_PROMPTS: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
LOCK_FILE = Path(tempfile.gettempdir()) / "shardprep-vllm-harness.lock"
DIST_IDENT = re.compile(r"vllm_dist_[0-9a-f]{32}")
LOG = logging.getLogger("vllm_env")
DUMP_NAME = re.compile(r"(target|draft)-pp(\d+)-tp(\d+)\.safetensors")
STDERR_TAIL = 6000

DumpFiles = dict[tuple[str, int, int], Path]
Run = subprocess.Popen[str] | zygote_client.ZygoteRun  # a run in a fresh interpreter, or forked


class VllmRunError(RuntimeError):
    """A vLLM subprocess failed or timed out; the message ends with its output's tail."""


@functools.cache
def vllm_python() -> str | None:
    """The interpreter that has vLLM installed, or None."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


def require_python() -> str:
    python = vllm_python()
    if python is None:
        raise VllmRunError(f"no vLLM python: set {PYTHON_ENV} or create {REPO}/.venv-vllm")
    return python


def torchvision_path() -> Path | None:
    """torchvision's Python part, which scripts/test.sh keeps beside the vLLM venv, or None."""
    python = vllm_python()
    path = Path(python).parents[1] / "torchvision-python" if python else None
    return path if path is not None and (path / "torchvision").is_dir() else None


def with_torchvision(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` for a run that imports torchvision (vLLM's Qwen3.5 classes): its Python part
    and the operator schemas it needs (torchvision_ops/sitecustomize.py) on PYTHONPATH."""
    path = torchvision_path()
    if path is None:
        raise VllmRunError("no torchvision beside the vLLM python: run scripts/test.sh once")
    paths = [str(SUPPORT / "torchvision_ops"), str(path), os.environ.get("PYTHONPATH", "")]
    return {**(env or {}), "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@functools.cache
def require_dump_plugin() -> None:
    """Fail clearly if the test-only plugin (load format dump-default) is not installed."""
    probe = (
        "import importlib.metadata as m;"
        "print(' '.join(e.name for e in m.entry_points(group='vllm.general_plugins')))"
    )
    out = subprocess.run(
        [require_python(), "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    if DUMP_PLUGIN not in out.split():
        raise VllmRunError(
            f"the {DUMP_FORMAT} plugin is not installed in the vLLM environment: run "
            f"{require_python()} -m pip install -e {REPO / 'tests' / 'vllm_dump_plugin'}"
        )


def thread_binding(world_size: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND: one core per rank, round robin; None for one rank."""
    if world_size <= 1:
        return None
    cores = max(1, min(os.cpu_count() or 1, 2))
    return "|".join(str(rank % cores) for rank in range(world_size))


def vllm_environ(world_size: int, tmpdir: Path, extra: Mapping[str, str] | None) -> dict[str, str]:
    """The subprocess environment: loopback only, a private TMPDIR, one OpenMP thread per
    rank when there are several, workers stopped after 1 s of grace (vLLM waits 5 s for
    each run's workers to wind down by themselves). The KV cache is sized by the runner
    (`kv_cache_memory_bytes`), which the legacy VLLM_CPU_KVCACHE_SPACE would override."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(
        VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        TMPDIR=str(tmpdir),
        PYTHONUNBUFFERED="1",
    )
    binding = thread_binding(world_size)
    if binding is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding
        # Each worker computes on its one core. Forked workers (see vllm_runner.py) keep
        # the OpenMP pool of the process they come from: one thread, as a spawned worker
        # is given (two made a tp2 x pp2 generation 5 times slower).
        env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


@contextlib.contextmanager
def one_vllm_at_a_time() -> Iterator[None]:
    """Serialize vLLM runs of this machine's test processes (they share 2 cores)."""
    with open(LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_dist_files(tmpdir: Path, output: str) -> None:
    """Remove the run's TMPDIR and the /dev/shm and /tmp files named after its dist idents.

    The ident (``vllm_dist_<hex>``) is the file store's name in TMPDIR, which vLLM deletes
    itself; the workers log it (``distributed_init_method=file://...``), so take it from the
    run's output too. The CPU shared-memory groups ``/dev/shm/<ident>-tp:0-[0-1]-cpushm_0``
    and the like outlive even a successful run.
    """
    idents = set(DIST_IDENT.findall(output)) | {p.name for p in tmpdir.glob("vllm_dist_*")}
    for ident in idents:
        for root in (Path("/dev/shm"), Path("/tmp")):
            for path in root.glob(f"{ident}*"):
                path.unlink(missing_ok=True)
    shutil.rmtree(tmpdir, ignore_errors=True)


def shared_memory_files() -> set[Path]:
    """Python's shared memory blocks and semaphores in /dev/shm: a run stopped by a kill
    leaves those of its message queues behind (one vLLM runs at a time, so the new ones
    are its own)."""
    root = Path("/dev/shm")
    return {*root.glob("psm_*"), *root.glob("sem.mp-*")} if root.is_dir() else set()


def kill_group(proc: Run) -> None:
    """Kill the process group that this helper started (the runner is its leader)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_python(
    args: list[str],
    world_size: int,
    env: Mapping[str, str] | None,
    timeout: float,
    done: Callable[[], bool] | None = None,
) -> str:
    """Run ``vllm-python ARGS`` in its own session; return stdout, raise with the tail.

    ``done``: polled every half second; once it holds, the run has given what was asked of
    it (a state dump is taken right after loading), and it is stopped there.
    """
    tmpdir = Path(tempfile.mkdtemp(prefix="shardprep-vllm-"))
    cmd = [require_python(), *args]
    asked = time.monotonic()
    with one_vllm_at_a_time():
        shared_before = shared_memory_files()
        started = time.monotonic()
        run_env = vllm_environ(world_size, tmpdir, env)
        proc = zygote_client.start(cmd[0], args, run_env, REPO) or subprocess.Popen(
            cmd, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        stdout, stderr, timed_out, stopped = "", "", False, False
        try:
            stdout, stderr, stopped = communicate(proc, started + timeout, done)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            stdout, stderr = proc.communicate()
        finally:
            kill_group(proc)  # stray workers, if the runner left any
            remove_dist_files(tmpdir, stdout + stderr)
            for path in shared_memory_files() - shared_before:
                path.unlink(missing_ok=True)
    LOG.info(
        "vLLM run took %.0f s (after %.0f s waiting for the lock)%s: %s",
        time.monotonic() - started,
        started - asked,
        ", stopped once done" if stopped else "",
        " ".join(cmd),
    )
    if timed_out:
        raise VllmRunError(failure(cmd, f"timed out after {timeout:.0f} s", stdout, stderr))
    given = stopped or (done is not None and done())  # a failure after that is not the run's
    if proc.returncode != 0 and not given:
        raise VllmRunError(failure(cmd, f"exit code {proc.returncode}", stdout, stderr))
    return stdout


def communicate(
    proc: Run, deadline: float, done: Callable[[], bool] | None
) -> tuple[str, str, bool]:
    """(stdout, stderr, stopped early) once the run ends, or ``done`` holds and it is stopped."""
    while True:
        wait = deadline - time.monotonic() if done is None else 0.5
        try:
            stdout, stderr = proc.communicate(timeout=max(0.0, wait))
            return stdout, stderr, False
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
            if done is not None and done():
                kill_group(proc)
                stdout, stderr = proc.communicate()
                return stdout, stderr, True


def failure(cmd: list[str], why: str, stdout: str, stderr: str) -> str:
    errors = [line for line in stdout.splitlines() if "Error" in line][-20:]
    return (
        f"vLLM run failed ({why}): {' '.join(cmd)}\n"
        + "--- error lines of stdout ---\n"
        + "\n".join(errors)
        + "\n--- tail of stderr ---\n"
        + stderr[-STDERR_TAIL:]
    )


def parse_tokens(stdout: str) -> list[list[int]]:
    """The runner's result: its last stdout line that starts with ``{"tokens"``."""
    for line in reversed(stdout.splitlines()):
        if line.startswith('{"tokens"'):
            return [[int(t) for t in seq] for seq in json.loads(line)["tokens"]]
    raise VllmRunError("the vLLM runner printed no result line:\n" + stdout[-STDERR_TAIL:])


def runner_args(
    model_dir: Path | str,
    tp: int,
    pp: int,
    load_format: str,
    *,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 8,
    dtype: str = "float32",
    speculative_config: Mapping[str, Any] | None = None,
    model_loader_extra_config: Mapping[str, Any] | None = None,
    dump_dir: Path | str | None = None,
    enforce_eager: bool = False,
    server: bool = False,
    engine: Mapping[str, Any] | None = None,
) -> list[str]:
    args = [str(RUNNER), "--model", str(model_dir), "--tp", str(tp), "--pp", str(pp)]
    args += ["--load-format", load_format, "--dtype", dtype, "--max-tokens", str(max_tokens)]
    args += ["--prompts-json", json.dumps(prompts or DEFAULT_PROMPTS)]
    if speculative_config is not None:
        args += ["--speculative-config", json.dumps(dict(speculative_config))]
    if model_loader_extra_config is not None:
        args += ["--model-loader-extra-config", json.dumps(dict(model_loader_extra_config))]
    if dump_dir is not None:
        args += ["--dump-dir", str(dump_dir)]
    if enforce_eager:
        args.append("--enforce-eager")
    if engine:
        args += ["--engine-json", json.dumps(dict(engine))]
    if server:
        args.append("--server")
    return args


def generate(
    model_dir: Path | str,
    tp: int = 1,
    pp: int = 1,
    load_format: str = "auto",
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    **kw: Any,
) -> list[list[int]]:
    """Greedy token ids (``max_tokens`` each, EOS ignored) from an offline ``vllm.LLM``."""
    if load_format == DUMP_FORMAT:
        require_dump_plugin()
    args = runner_args(model_dir, tp, pp, load_format, **kw)
    return parse_tokens(run_python(args, tp * pp, env, timeout))


def run_until(
    done: Callable[[], bool],
    model_dir: Path | str,
    tp: int,
    pp: int,
    load_format: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    **kw: Any,
) -> None:
    """Run vLLM until ``done()`` holds, then stop it (or until it ends by itself); raise if
    it fails first. For runs that are asked for what loading leaves, not for tokens."""
    if load_format == DUMP_FORMAT:
        require_dump_plugin()
    args = runner_args(model_dir, tp, pp, load_format, **kw)
    run_python(args, tp * pp, env, timeout, done=done)


def dump_state(
    model_dir: Path | str,
    tp: int,
    pp: int,
    dump_dir: Path | str,
    *,
    max_tokens: int = 1,
    allow_engine_failure: bool = False,
    load_format: str = DUMP_FORMAT,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    **kw: Any,
) -> DumpFiles:
    """Run vLLM with ``--load-format dump-default`` (or ``dump-sharded-fast``: shardprep's
    loader, dumped the same way); the rank files it wrote.

    With a ``speculative_config`` the draft is dumped too (role ``draft``, last stage).
    ``allow_engine_failure``: only the state after loading counts, not what the engine
    does next (speculative decoding with pp > 1 loads, then crashes on the CPU): the run is
    stopped as soon as every expected rank file is written. Without it the run must end
    by itself, without error.
    """
    clear_dumps(dump_dir)
    expected = expected_dumps(tp, pp, kw.get("speculative_config") is not None)

    def complete() -> bool:
        return expected <= dump_files(dump_dir).keys()

    run_until(
        complete if allow_engine_failure else lambda: False, model_dir, tp, pp, load_format,
        env=env, timeout=timeout, dump_dir=dump_dir, max_tokens=max_tokens, **kw,
    )  # fmt: skip
    return dump_files(dump_dir)


def expected_dumps(tp: int, pp: int, with_draft: bool) -> set[tuple[str, int, int]]:
    """The rank files that a complete load writes: every target rank, the draft's last stage."""
    keys = {("target", p, t) for p in range(pp) for t in range(tp)}
    if with_draft:
        keys |= {("draft", pp - 1, t) for t in range(tp)}
    return keys


def clear_dumps(dump_dir: Path | str) -> None:
    """Remove earlier dump files from ``dump_dir`` (and create it)."""
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    for path in dump_files(dump_dir).values():
        path.unlink()


def dump_files(dump_dir: Path | str) -> DumpFiles:
    """``{(role, pp_rank, tp_rank): path}`` of the dump files in ``dump_dir``."""
    found: DumpFiles = {}
    for path in sorted(Path(dump_dir).glob("*.safetensors")):
        match = DUMP_NAME.fullmatch(path.name)
        if match:
            found[(match[1], int(match[2]), int(match[3]))] = path
    return found


def serve_and_complete(
    model_dir: Path | str,
    tp: int,
    pp: int,
    load_format: str,
    prompt_ids: list[int],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    **kw: Any,
) -> list[int]:
    """Greedy token ids of one ``/v1/completions`` request to a real OpenAI server."""
    args = runner_args(model_dir, tp, pp, load_format, prompts=[prompt_ids], server=True, **kw)
    return parse_tokens(run_python(args, tp * pp, env, timeout))[0]


def read_dump(path: Path | str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors of one dump file and its metadata (JSON values decoded)."""
    from safetensors.torch import load_file

    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
    raw = header.get("__metadata__", {})
    return load_file(str(path)), {key: json.loads(value) for key, value in raw.items()}


def transformers_greedy(
    model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy continuation with Hugging Face transformers (full forward each step, EOS
    ignored as the runner does), in float32: the reference every layout must equal."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outputs = []
    for ids in prompts:
        seq = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(max_tokens):
                next_id = model(seq).logits[0, -1].argmax().view(1, 1)
                seq = torch.cat([seq, next_id], dim=1)
        outputs.append(seq[0, len(ids) :].tolist())
    return outputs
