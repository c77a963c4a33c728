"""The promise that matters most: loading never issues a collective.

Four real processes in a gloo group (tp2 x pp2, with tp and pp subgroups) load their
rank files through the shardprep reader, only the last stage loads the draft, and every
torch.distributed collective and point-to-point call is patched to fail: all finish.
The seed scenario beside it (vLLM issue #50959): the same four ranks, the draft loaded
with fastsafetensors' ParallelLoader on the WORLD group by the last stage only, hang.
A static guard checks that no module of the package calls a collective.

This file is also the worker: `python tests/loader/test_collective_free.py --mode ... --rank R`.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

TP, PP = 2, 2
WORLD = TP * PP
LAST = PP - 1
FINISH_TIMEOUT_S = 120.0  # four torch imports on two cores; a load takes well under 1 s
START_TIMEOUT_S = 90.0
HANG_S = 10.0  # a load takes well under 1 s once the ranks have started
PACKAGE = Path(__file__).resolve().parents[2] / "shardprep"

# Everything in torch.distributed that talks to other ranks.
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "all_gather_single", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv", "_all_gather_base",
    "_reduce_scatter_base", "_broadcast_coalesced",
)  # fmt: skip
PROCESS_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
    "all_gather_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "gather", "scatter", "reduce",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "send", "recv",
    "recv_anysource",
)  # fmt: skip
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast",
)  # fmt: skip


# --- the worker -------------------------------------------------------------------------


def forbid_collectives() -> list[str]:
    """Make every collective and point-to-point call record its name and raise."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional
    import torch.distributed.distributed_c10d as c10d

    calls: list[str] = []

    def refusing(name: str) -> Callable[..., None]:
        def refuse(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise RuntimeError(f"{name} was called during a rank-local load")

        return refuse

    for module in (dist, c10d):
        for name in COLLECTIVES:
            if hasattr(module, name):
                setattr(module, name, refusing(f"torch.distributed.{name}"))
    for name in PROCESS_GROUP_METHODS:
        if hasattr(dist.ProcessGroup, name):
            setattr(dist.ProcessGroup, name, refusing(f"ProcessGroup.{name}"))
    for name in FUNCTIONAL_COLLECTIVES:
        if hasattr(functional, name):
            setattr(functional, name, refusing(f"functional.{name}"))
    return calls


def check_the_patch(calls: list[str]) -> None:
    """The patch is not vacuous: a real barrier and a group broadcast are refused."""
    import torch
    import torch.distributed as dist

    for attempt in (dist.barrier, lambda: dist.group.WORLD.broadcast([torch.zeros(1)], None)):
        try:
            attempt()
        except RuntimeError:
            continue
        raise AssertionError("a collective went through the patch")
    assert calls == ["torch.distributed.barrier", "ProcessGroup.broadcast"], calls
    calls.clear()


def init_groups(rank: int, port: int) -> tuple[int, int]:
    """The WORLD group plus vLLM-like tp and pp subgroups; returns (pp_rank, tp_rank)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    for pp in range(PP):
        dist.new_group([pp * TP + tp for tp in range(TP)])
    for tp in range(TP):
        dist.new_group([pp * TP + tp for pp in range(PP)])
    return divmod(rank, TP)


def load_and_compare(artifact: Path, role: str, pp_rank: int, tp_rank: int) -> int:
    """Read one rank through the shardprep reader and compare with safetensors."""
    import torch
    from safetensors.torch import load_file

    from shardprep.format.manifest import read_manifest
    from shardprep.loader.reader import read_rank

    manifest = read_manifest(artifact)
    want: dict[str, torch.Tensor] = {}
    for entry in manifest.rank_files(role, pp_rank, tp_rank):
        want.update(load_file(artifact / entry.path))
    got = dict(read_rank(artifact, role, pp_rank, tp_rank, manifest=manifest))
    assert sorted(got) == sorted(want), (role, pp_rank, tp_rank)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    return len(got)


def run_shardprep(args: argparse.Namespace) -> int:
    pp_rank, tp_rank = init_groups(args.rank, args.port)
    calls = forbid_collectives()
    check_the_patch(calls)
    count = load_and_compare(args.artifact, "target", pp_rank, tp_rank)
    if pp_rank == LAST:
        count += load_and_compare(args.artifact, "draft", pp_rank, tp_rank)
    from shardprep.loader.reader import backend_in_use

    print(f"LOADED {count} tensors with {backend_in_use()}; calls={calls}", flush=True)
    return 0 if not calls and backend_in_use() == "fastsafetensors" else 3


def run_parallel_loader(args: argparse.Namespace) -> int:
    """vLLM's fastsafetensors path for the draft: the WORLD group, last stage only."""
    import torch.distributed as dist

    pp_rank, tp_rank = init_groups(args.rank, args.port)
    load_and_compare(args.artifact, "target", pp_rank, tp_rank)
    print("TARGET-DONE", flush=True)
    if pp_rank != LAST and not args.all_join:
        time.sleep(600)  # the first stages go on to their next step and never join
        return 0
    from fastsafetensors import ParallelLoader

    print("DRAFT-START", flush=True)
    loader = ParallelLoader(
        pg=dist.group.WORLD, hf_weights_files=[str(args.draft_file)], device="cpu",
        nogds=True, use_tqdm_on_load=False,
    )  # fmt: skip
    for _ in loader.iterate_weights():
        pass
    print("DRAFT-DONE", flush=True)
    # Left open, the loader's native threads can abort the interpreter at exit
    # ("terminate called without an active exception", seen once on rank 2).
    loader.close()
    dist.destroy_process_group()
    return 0


def worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["shardprep", "parallel-loader"], required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--draft-file", type=Path)
    parser.add_argument("--all-join", action="store_true", help="every stage loads the draft")
    args = parser.parse_args(argv)
    run = run_shardprep if args.mode == "shardprep" else run_parallel_loader
    return run(args)


# --- the tests --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.convert.run import Options, convert

    model = tiny.model("collective-llama")
    draft = tiny.draft("collective-eagle3", model)
    out = tmp_path_factory.mktemp("collective") / "out"
    convert(str(model), out, Options(tp=TP, pp=PP, draft=str(draft)), progress=False)
    return out


def start_ranks(mode: str, artifact: Path, logs: Path, extra: list[str]) -> list:
    from ports import free_port  # tests/support: this file also runs as each rank's script

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(WORLD):
        cmd = [sys.executable, __file__, "--mode", mode, "--rank", str(rank)]
        cmd += ["--port", str(port), "--artifact", str(artifact), *extra]
        with open(logs / f"rank{rank}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
    return procs


def stop(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def log_of(logs: Path, rank: int) -> str:
    return (logs / f"rank{rank}.log").read_text()


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.slow
def test_rank_local_loads_issue_no_collective(artifact: Path, tmp_path: Path) -> None:
    procs = start_ranks("shardprep", artifact, tmp_path, [])
    try:
        finished = wait_until(lambda: all(p.poll() is not None for p in procs), FINISH_TIMEOUT_S)
    finally:
        stop(procs)
    logs = "\n".join(f"--- rank {r}\n{log_of(tmp_path, r)}" for r in range(WORLD))
    assert finished, f"the ranks did not finish within {FINISH_TIMEOUT_S:.0f} s:\n{logs}"
    assert [p.returncode for p in procs] == [0] * WORLD, logs
    for rank in range(WORLD):
        assert "with fastsafetensors; calls=[]" in log_of(tmp_path, rank), logs


@pytest.mark.slow
def test_seed_scenario_parallel_loader_on_world_group_hangs(
    artifact: Path, tiny, tmp_path: Path
) -> None:
    draft_file = tiny.draft("collective-eagle3", tiny.model("collective-llama"))
    draft_file = draft_file / "model.safetensors"
    procs = start_ranks("parallel-loader", artifact, tmp_path, ["--draft-file", str(draft_file)])
    last = [pp_tp for pp_tp in range(WORLD) if pp_tp // TP == LAST]
    try:
        started = wait_until(
            lambda: (
                all("DRAFT-START" in log_of(tmp_path, r) for r in last)
                or any(p.poll() is not None for p in procs)
            ),
            START_TIMEOUT_S,
        )
        assert started and all(p.poll() is None for p in procs), [
            log_of(tmp_path, r) for r in range(WORLD)
        ]
        time.sleep(HANG_S)
        alive = [p.poll() is None for p in procs]
        logs = [log_of(tmp_path, r) for r in range(WORLD)]
    finally:
        stop(procs)
    assert all("TARGET-DONE" in log for log in logs), logs
    assert all(alive), f"a rank exited instead of hanging: {logs}"
    assert not any("DRAFT-DONE" in logs[r] for r in last), (
        "the last stage finished a WORLD-group draft load that the other stages never joined"
    )


@pytest.mark.slow
def test_control_parallel_loader_completes_when_every_rank_joins(
    artifact: Path, tiny, tmp_path: Path
) -> None:
    """The hang above comes from the stages that do not join, not from the set-up."""
    draft_file = tiny.draft("collective-eagle3", tiny.model("collective-llama"))
    extra = ["--draft-file", str(draft_file / "model.safetensors"), "--all-join"]
    procs = start_ranks("parallel-loader", artifact, tmp_path, extra)
    try:
        finished = wait_until(lambda: all(p.poll() is not None for p in procs), FINISH_TIMEOUT_S)
    finally:
        stop(procs)
    logs = [log_of(tmp_path, r) for r in range(WORLD)]
    assert finished and [p.returncode for p in procs] == [0] * WORLD, logs
    assert all("DRAFT-DONE" in log for log in logs), logs


# --- the static guard -------------------------------------------------------------------

# Names that are collectives only when called on a group-like receiver (`dist.send`,
# `get_pp_group().barrier()`), and names that are collectives on any receiver.
GENERIC = {"broadcast", "barrier", "send", "recv", "gather", "scatter", "reduce", "allreduce",
           "allgather", "alltoall", "send_object", "recv_object"}  # fmt: skip
UNAMBIGUOUS = (set(COLLECTIVES) - GENERIC) | {
    "broadcast_object", "broadcast_tensor_dict", "send_tensor_dict", "recv_tensor_dict",
    "all_gatherv", "reduce_scatterv", "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_gather", "tensor_model_parallel_gather",
    "tensor_model_parallel_reduce_scatter",
}  # fmt: skip
GROUP_LIKE = re.compile(r"dist|group|pg\b|_pg|process_group", re.IGNORECASE)


def collective_uses(source: str, filename: str = "<string>") -> list[str]:
    """Every place that uses torch.distributed, calls something collective, or names
    fastsafetensors' ParallelLoader."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if _forbidden_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name for a in node.names}
            if _forbidden_module(module) or (module == "torch" and "distributed" in names):
                found.append(f"{where}: from {module} import {', '.join(sorted(names))}")
            elif "ParallelLoader" in names:
                found.append(f"{where}: imports ParallelLoader")
        elif isinstance(node, ast.Attribute) and ast.unparse(node) == "torch.distributed":
            found.append(f"{where}: torch.distributed")
        elif isinstance(node, (ast.Name, ast.Attribute)) and _name(node) == "ParallelLoader":
            found.append(f"{where}: ParallelLoader")
        elif isinstance(node, ast.Call) and _is_collective_call(node):
            found.append(f"{where}: calls {ast.unparse(node.func)}")
    return found


def _forbidden_module(module: str) -> bool:
    return module.startswith("torch.distributed") or module.endswith("parallel_loader")


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _is_collective_call(call: ast.Call) -> bool:
    name = _name(call.func)
    if name in UNAMBIGUOUS:
        return True
    if name not in GENERIC or not isinstance(call.func, ast.Attribute):
        return False
    return bool(GROUP_LIKE.search(ast.unparse(call.func.value)))


def test_the_guard_sees_collectives() -> None:
    bad = """
import torch
import torch.distributed as dist
from fastsafetensors import ParallelLoader
from vllm.distributed import get_pp_group
dist.broadcast(t, 0)
get_pp_group().broadcast_object(x)
get_pp_group().barrier()
torch.distributed.all_reduce(t)
pg.send([t], 1, 0)
"""
    found = collective_uses(bad)
    assert len(found) == 8, found
    assert collective_uses("import asyncio\nasyncio.gather(a, b)\nsock.send(b'x')\n") == []


# The one module that may name torch.distributed: the set-up of the child process that
# derives a layout (plan/derived), which builds vLLM's model of one rank offline over
# torch's fake process group, where nothing reaches another process; no loader and no
# vLLM worker ever imports it.
OFFLINE_FAKE_GROUP = "shardprep/plan/derived/engine.py"


def test_no_module_of_the_package_calls_a_collective() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE.parent))
        if name != OFFLINE_FAKE_GROUP:
            found += collective_uses(path.read_text(), name)
    assert found == [], "rank-local loading must not use torch.distributed:\n" + "\n".join(found)


def test_only_the_deriving_child_names_torch_distributed_and_only_with_a_fake_group() -> None:
    """The exception above is that module alone, and its process group is the fake one."""
    text = (PACKAGE.parent / OFFLINE_FAKE_GROUP).read_text()
    assert collective_uses(text, OFFLINE_FAKE_GROUP)
    assert 'init_process_group("fake"' in text and 'backend="fake"' in text


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
