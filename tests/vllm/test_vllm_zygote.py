"""The harness's zygote (tests/support/vllm_zygote.py): it forks only while it runs one
thread, and a run it forks gives what a run in a fresh interpreter gives."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import vllm_env
import vllm_zygote
import zygote_client

from shardprep.demo.tiny import make_tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
MAX_TOKENS = 6


def ask_to_fork(tmp_path: Path) -> dict[str, object]:
    """One request served by `vllm_zygote.serve` in this process, over a socket pair; its
    answer. A run that did fork would fail at once (its folder does not exist)."""
    request = {
        "argv": [], "env": {}, "cwd": str(tmp_path / "absent"),
        "stdout": str(tmp_path / "out"), "stderr": str(tmp_path / "err"),
    }  # fmt: skip
    ours, theirs = socket.socketpair()
    with ours, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        ours.sendall(json.dumps(request).encode() + b"\n")
        vllm_zygote.serve(theirs, server)
        return json.loads(ours.makefile("rb").readline())


def test_the_threads_are_counted_as_the_kernel_lists_them() -> None:
    """A thread shows in `thread_ids` while it runs, and makes a fork refused; once it has
    ended, it is gone from the list."""
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="helper")
    helper.start()
    try:
        assert helper.native_id in vllm_zygote.thread_ids()
        assert vllm_zygote.fork_refusal() is not None
    finally:
        stop.set()
        helper.join()
    deadline = time.monotonic() + 10  # the kernel's thread ends just after Python's join
    while helper.native_id in vllm_zygote.thread_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert helper.native_id not in vllm_zygote.thread_ids()


def test_the_zygote_refuses_to_fork_beside_another_thread(tmp_path: Path) -> None:
    """A second thread (here one that waits, as a library's pool would): no fork, an error
    that counts the threads and names the Python ones."""
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="a-pool-worker")
    helper.start()
    try:
        answer = ask_to_fork(tmp_path)
    finally:
        stop.set()
        helper.join()
    assert "pid" not in answer
    error = str(answer["error"])
    assert error.startswith("the vLLM zygote runs ")
    assert "a-pool-worker" in error and "where a fork needs one" in error


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(vllm_env.vllm_python() is None, reason="no vLLM python found")
def test_a_forked_run_equals_a_fresh_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tiny Llama loaded and run twice: forked from a zygote (which checked that it
    ran one thread), then in a fresh interpreter. Same tokens, and the same tensors after
    loading, byte for byte."""
    if os.environ.get(zygote_client.DISABLE_ENV) == "0":
        pytest.skip(f"{zygote_client.DISABLE_ENV}=0: no run is forked")
    model = make_tiny_model(tmp_path / "model")
    runs = {}
    for how in ("forked", "fresh"):
        if how == "fresh":
            monkeypatch.setenv(zygote_client.DISABLE_ENV, "0")
        forked_before = zygote_client.forked_runs
        tokens = vllm_env.generate(
            model, 1, 1, vllm_env.DUMP_FORMAT, prompts=PROMPTS, max_tokens=MAX_TOKENS,
            dump_dir=tmp_path / how,
        )  # fmt: skip
        assert zygote_client.forked_runs - forked_before == (how == "forked"), how
        dumps = vllm_env.dump_files(tmp_path / how)
        assert sorted(dumps) == [("target", 0, 0)], how
        runs[how] = (tokens, vllm_env.read_dump(dumps[("target", 0, 0)])[0])
    (forked_tokens, forked_state), (fresh_tokens, fresh_state) = runs["forked"], runs["fresh"]
    assert len(forked_tokens) == len(PROMPTS)
    assert all(len(t) == MAX_TOKENS for t in forked_tokens)
    assert forked_tokens == fresh_tokens
    assert sorted(forked_state) == sorted(fresh_state)
    for name, tensor in forked_state.items():
        other = fresh_state[name]
        assert (tensor.dtype, tensor.shape) == (other.dtype, other.shape), name
        assert torch.equal(raw_bytes(tensor), raw_bytes(other)), name


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
