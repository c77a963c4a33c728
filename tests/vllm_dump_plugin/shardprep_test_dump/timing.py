"""Benchmark-only: every rank's ``load_weights``, of every loader, timed by one wrapper.

With ``$SHARDPREP_LOAD_TIMES`` set to a file, ``install`` wraps ``load_weights`` of
vLLM's ``DefaultModelLoader`` (``auto``/``safetensors``), of ``ShardedStateLoader``
(``sharded_state``) and of shardprep's ``ShardedFastLoader`` (``sharded-fast``) in the
process that calls it (vLLM calls the plugin in every worker). Each call appends one
JSON line to that file: the loader, the load format, the role, the pp and tp rank, the
seconds the call took, the CPU seconds the process spent meanwhile (every thread: a
figure that other jobs on a shared machine disturb less) and the resident memory before
and after it. vLLM's own
"Loading weights took" lines cannot serve here: they are logged by the first rank only,
and they time a different span than shardprep's.

Without the variable nothing is wrapped.
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from shardprep_test_dump import TIMES_ENV

WRAPPED = "_shardprep_timed"
# Nested calls (a loader that delegates to another, as the dump loaders do) are timed
# once, by the outermost wrapper.
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("shardprep_timed", default=False)


def loader_classes() -> dict[str, type]:
    """The loaders whose ``load_weights`` is timed, by label."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    from shardprep.loader.plugin import ShardedFastLoader

    return {
        "default": DefaultModelLoader,
        "sharded_state": ShardedStateLoader,
        "sharded-fast": ShardedFastLoader,
    }


def install() -> bool:
    """Wrap the loaders' ``load_weights`` (once per class) when ``$SHARDPREP_LOAD_TIMES``
    is set; whether it is."""
    path = os.environ.get(TIMES_ENV)
    if not path:
        return False
    for label, cls in loader_classes().items():
        original = cls.__dict__.get("load_weights")
        if original is None or getattr(original, WRAPPED, False):
            continue
        cls.load_weights = timed(original, label, path)
    return True


def timed(original: Callable[..., None], label: str, path: str) -> Callable[..., None]:
    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        if _inside.get():
            return original(self, model, model_config)
        token = _inside.set(True)
        rss_before = resident_bytes()
        cpu_started = time.process_time()
        started = time.perf_counter()
        try:
            return original(self, model, model_config)
        finally:
            seconds = time.perf_counter() - started
            cpu_seconds = time.process_time() - cpu_started
            _inside.reset(token)
            record(path, label, self, model_config, (seconds, cpu_seconds), rss_before)

    setattr(load_weights, WRAPPED, True)
    return load_weights


def record(
    path: str,
    label: str,
    loader: Any,
    model_config: Any,
    seconds: tuple[float, float],
    rss_before: int,
) -> None:
    """One line: `seconds` is (wall, CPU of the whole process, every thread) of the call."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    line = {
        "loader": label,
        "load_format": str(getattr(loader.load_config, "load_format", "")),
        "role": role_of(model_config),
        "pp_rank": get_pp_group().rank_in_group,
        "tp_rank": get_tensor_model_parallel_rank(),
        "seconds": seconds[0],
        "cpu_seconds": seconds[1],
        "rss_before": rss_before,
        "rss_after": resident_bytes(),
        "pid": os.getpid(),
        "ended": time.time(),
    }
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)  # one short write with O_APPEND: lines of ranks never mix
    finally:
        os.close(fd)


def role_of(model_config: Any) -> str:
    """``target`` or ``draft`` by identity with the worker's current config."""
    from vllm.config import get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None:
        spec = current.speculative_config
        if spec is not None and model_config is spec.draft_model_config:
            return "draft"
        if model_config is current.model_config:
            return "target"
    return "unknown"


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_times(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The lines the ranks wrote, in the order written."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
