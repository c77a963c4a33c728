"""Qwen3-Next (`Qwen3NextForCausalLM`) and its MTP draft in a real vLLM (CPU build). The
draft is the `mtp.*` tensors inside the target checkpoint; vLLM is given no draft path.

- tp2 x pp2 in bfloat16, vLLM's default loader with the MTP draft: every rank file
  (target and draft) equals what vLLM leaves in memory after loading, byte for byte:
  DeltaNet layers (`in_proj_qkvz`/`in_proj_ba` in whole key-head groups, `conv1d` as the
  rank's q, k and v rows, `A_log` float32 from a bfloat16 checkpoint), gated attention
  (q_proj doubled for the gate), experts with a gated shared expert, the embedding and
  lm_head on every stage (the CPU engine fails after loading at pp > 1 with a draft, which
  leaves the state complete). At pp > 1 the draft holds its own embedding.
- tp2, speculating with the MTP draft, through vLLM's default loader and through
  `sharded-fast` with every collective refused while each rank loads: both leave each
  rank holding its rank files, and both give the same greedy tokens (bfloat16, which
  the CPU DeltaNet kernel needs, so not transformers' float32 tokens). The draft's
  lm_head and, at pp = 1, its embedding, which vLLM replaces with the target's right
  after loading, are the only parameters the files leave out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import MTP, TRAP, assert_same_state, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
NEXT = "Qwen3NextForCausalLM"
HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
# vLLM's CPU DeltaNet kernel runs in bfloat16 only, and its prefix caching of DeltaNet
# state runs a Triton kernel when a draft speculates: both settings let it generate.
SPECULATING = {"dtype": "bfloat16", "engine": {"enable_prefix_caching": False}}


def next_model(root: Path) -> Path:
    """Four layers: linear, full, linear, full (two per stage at pp2), one MTP layer."""
    return make_tiny_model(root / "model", NEXT)


def test_qwen3_next_rank_files_equal_vllm_state_at_tp2_pp2_with_the_mtp_draft(
    tmp_path: Path,
) -> None:
    model = next_model(tmp_path)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    draft = read_manifest(artifact).model("draft")
    assert (draft.method, draft.folder, draft.shared_with_target) == ("mtp", "draft", (HEAD,))
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "dump", dtype="bfloat16", speculative_config=MTP,
        allow_engine_failure=True,
    )  # fmt: skip
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared={HEAD}):
        state, ours, p = rank.state, rank.ours, rank.pp
        if rank.role == "draft":
            assert rank.meta["model_class"] == "Qwen3NextMTP"
            assert EMBED in ours and "model.fc.weight" in ours
        else:
            assert not [n for n in ours if n.startswith("mtp.")]
            assert {EMBED, HEAD} <= set(ours)  # on every stage
            linear, full = 2 * p, 2 * p + 1
            a_log = state[f"model.layers.{linear}.linear_attn.A_log"]
            conv = state[f"model.layers.{linear}.linear_attn.conv1d.weight"]
            qkv = state[f"model.layers.{full}.self_attn.qkv_proj.weight"]
            assert (a_log.dtype, tuple(a_log.shape)) == (torch.float32, (2,))
            assert tuple(conv.shape) == ((256 + 256 + 512) // 2, 1, 4)
            assert tuple(qkv.shape) == ((2 * 4 * 32 + 2 * 2 * 32) // 2, 128)
        assert_same_state(state, ours)


def test_qwen3_next_mtp_speculates_through_sharded_fast_at_tp2_with_collectives_refused(
    tmp_path: Path,
) -> None:
    model = next_model(tmp_path)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    assert shared == {EMBED, HEAD}
    runs = {}
    for loader, env in (("dump-default", {}), ("dump-sharded-fast", TRAP)):
        dump_dir = tmp_path / loader
        runs[loader] = vllm_env.generate(
            model if loader == "dump-default" else artifact, 2, 1, loader,
            speculative_config=MTP, dump_dir=dump_dir, env=env, **SPECULATING,
        )  # fmt: skip
        dumps = vllm_env.dump_files(dump_dir)
        # a draft's shared parameters are left out: vLLM shares the target's next
        for rank in rank_dumps(dumps, artifact, tp=2, pp=1, draft=True, shared=shared):
            if loader == "dump-sharded-fast":
                assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == []
            assert_same_state(rank.state, rank.ours)
    assert [len(seq) for seq in runs["dump-default"]] == [8, 8]
    assert runs["dump-sharded-fast"] == runs["dump-default"]
