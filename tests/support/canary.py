"""The canary's shared checks: what a real vLLM left on each rank against shardprep's rank
files, or against another vLLM run, byte for byte.

    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared=shared):
        ...  # rank.role, rank.pp, rank.tp, rank.state, rank.meta, rank.ours
        assert_same_state(rank.state, rank.ours)

`rank_dumps` walks every (role, stage, rank) of a dump in order, after checking that the
dump holds exactly the ranks of the topology; `assert_rank_files_equal_dumps` and
`assert_same_dumps` are the two whole comparisons most tests end with.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import vllm_env
from artifacts import rank_tensors

from shardprep.plan.quant import never_loaded

State = dict[str, torch.Tensor]
Key = tuple[str, int, int]

# Every collective a rank issues while it loads is refused and recorded (the dump plugin's
# trap.py); a run's meta then says the trap was armed and lists the calls it caught.
TRAP = {"SHARDPREP_TRAP_COLLECTIVES": "1"}
# The dump plugin stands in for the kernel choice alone (kernels.py), for the quantized
# layers the CPU build has no kernel for; STATE_ONLY also sets post-processing aside, so
# that the state right after `load_weights` is what is dumped.
STUB = {"SHARDPREP_STUB_KERNELS": "1"}
STATE_ONLY = STUB | {"SHARDPREP_SKIP_POSTPROCESS": "1"}
MTP = {"method": "mtp", "num_speculative_tokens": 1}
# Tokens are compared in float32: in bfloat16 vLLM's CPU build does not give the same
# greedy tokens from one run to the next (batching moves near-ties). float32 MLA needs the
# CPU_MLA attention backend, for the draft too: its backend is a setting of its own, and
# left unset vLLM picks AMX_MLA for it on a CPU with AMX tiles, whose weight packing takes
# 16-bit weights only ("expect weight to be bfloat16, float16, ..."). The reference
# speculates too: a step that verifies a draft token runs MLA over two query positions,
# not one, and on a random tiny model that moves near-ties even in float32 (seen: the
# second of eight tokens differed from plain greedy decoding), so only the same
# speculative run with vLLM's own loader is a bitwise reference.
FLOAT32_MTP = {
    "dtype": "float32",
    "engine": {"attention_config": {"backend": "CPU_MLA"}},
    "speculative_config": MTP | {"attention_backend": "CPU_MLA"},
}
# Whether a draft holds its own embedding and head after loading (else vLLM shares the
# target's), as the dump plugin records them.
FLAGS = ("has_own_embed_tokens", "has_own_lm_head")
_OWN_FLAG = {
    "model.embed_tokens.weight": "has_own_embed_tokens",
    "lm_head.weight": "has_own_lm_head",
}


def assert_same_state(vllm_state: Mapping[str, torch.Tensor], ours: Mapping[str, Any]) -> None:
    """The same names, dtypes, shapes and bytes (0-d scales too)."""
    assert sorted(ours) == sorted(vllm_state)
    for name, expected in vllm_state.items():
        got = ours[name]
        assert (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape)), name
        raw = expected.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(got.reshape(-1).view(torch.uint8), raw), name


def without(state: Mapping[str, Any], names: Collection[str]) -> dict[str, Any]:
    return {name: value for name, value in state.items() if name not in names}


def from_checkpoint(state: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters vLLM loads from a checkpoint (not the KV-cache scales it creates and
    leaves unloaded)."""
    return {name: value for name, value in state.items() if not never_loaded(name)}


def loaded(state: State, meta: dict, shared: set[str]) -> State:
    """The parameters a load filled: a draft parameter its checkpoint lacks is left
    unloaded by vLLM, which then shares the target's, and shardprep writes none for it."""
    if meta["role"] != "draft":
        return state
    unloaded = {n for n in shared if n in state and not meta[_OWN_FLAG[n]]}
    return without(state, unloaded)


@dataclass(frozen=True)
class RankDump:
    """One rank of a vLLM dump: what vLLM left there (`state`, `meta`) and, read on first
    use, the rank files of the artifact it is compared with (`ours`)."""

    role: str
    pp: int
    tp: int
    state: State
    meta: dict[str, Any]
    artifact: Path | None

    @property
    def key(self) -> Key:
        return (self.role, self.pp, self.tp)

    @cached_property
    def ours(self) -> State:
        assert self.artifact is not None, "rank_dumps was given no artifact"
        return rank_tensors(self.artifact, self.role, self.pp, self.tp)


def rank_dumps(
    dumps: vllm_env.DumpFiles,
    artifact: Path | None = None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    draft: bool = False,
    shared: Collection[str] = (),
) -> Iterator[RankDump]:
    """Every (role, stage, rank) of a vLLM dump in order, each read once, beside the rank
    files of `artifact`. Given `tp` and `pp`, the dump must hold exactly the ranks of that
    topology (and a draft's on the last stage if `draft`). A draft's `state` leaves out the
    parameters in `shared`, which vLLM swaps for the target's after loading."""
    if tp is not None or pp is not None:
        assert tp is not None and pp is not None, "give both tp and pp"
        assert sorted(dumps) == sorted(vllm_env.expected_dumps(tp, pp, with_draft=draft))
    for role, p, t in sorted(dumps):
        state, meta = vllm_env.read_dump(dumps[(role, p, t)])
        if role == "draft":
            state = without(state, shared)
        yield RankDump(role, p, t, state, meta, artifact)


def assert_rank_files_equal_dumps(
    artifact: Path, dumps: vllm_env.DumpFiles, shared: Collection[str] = ()
) -> None:
    """Every rank file of `artifact` equals what vLLM left on its rank."""
    for rank in rank_dumps(dumps, artifact, shared=shared):
        assert_same_state(rank.state, rank.ours)


def assert_same_dumps(
    ours: vllm_env.DumpFiles,
    default: vllm_env.DumpFiles,
    leave_out: Mapping[Key, Collection[str]] | None = None,
) -> None:
    """What sharded-fast left equals what the default loader left (but the parameters
    `leave_out` names for a rank); its load ran with every collective trapped (the trap
    was armed and caught no call)."""
    assert ours.keys() == default.keys()
    for rank in rank_dumps(ours):
        expected, _ = vllm_env.read_dump(default[rank.key])
        assert rank.meta["trap_armed"] and rank.meta["collectives_trapped"] > 30, rank.meta
        assert rank.meta["collective_calls"] == []
        skip = (leave_out or {}).get(rank.key, set())
        assert_same_state(without(expected, skip), without(rank.state, skip))


def assert_generates_like_the_default_loader(
    model: Path, artifact: Path, tmp_path: Path, tp: int, pp: int
) -> dict[Key, State]:
    """Both loaders' greedy tokens and states, kernels stood in for; every rank file equals
    the default's state. Returns that state per rank."""
    run = {"dtype": "bfloat16", "max_tokens": 6, "env": STUB}
    default = vllm_env.generate(model, tp, pp, "dump-default", dump_dir=tmp_path / "d", **run)
    dumps = vllm_env.dump_files(tmp_path / "d")
    states = {}
    for rank in rank_dumps(dumps, artifact, tp=tp, pp=pp):
        states[rank.key] = from_checkpoint(rank.state)
        assert_same_state(states[rank.key], rank.ours)
    run["env"] = STUB | TRAP
    fast = vllm_env.generate(artifact, tp, pp, "dump-sharded-fast", dump_dir=tmp_path / "f", **run)
    assert all(len(tokens) == 6 for tokens in default)
    assert len({tuple(tokens) for tokens in default}) > 1 or len(set(default[0])) > 1
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "f"), dumps)
    return states
