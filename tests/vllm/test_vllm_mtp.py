"""DeepSeek-V3 MTP drafts in a real vLLM (CPU build, bfloat16). The draft is the MTP
layer inside the target checkpoint; vLLM is given no draft path, so it loads the draft
from the target's own folder.

- tp2 x pp2, vLLM's default loader: every rank file (target and draft) equals what vLLM
  leaves in memory after loading, byte for byte, V3's MLA with `q_lora_rank` and the
  float32 routing bias of a bfloat16 model included (the CPU engine fails after loading
  at pp > 1, which leaves the state complete). At pp > 1 the draft holds its own embedding.
- tp2 in float32, through `sharded-fast` with every collective refused while each rank
  loads: speculative decoding gives the tokens that vLLM's own loader gives with the same
  draft, target and draft hold their rank files; the lm_head copies (and at pp = 1 the
  embedding) that vLLM replaces with the target's after loading are the only parameters
  the files leave out. The same from a tp2 x pp2 artifact (its draft on its last stage)
  cut at load time: the same tokens, and every rank holds what the tp2 x pp1 files hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import FLOAT32_MTP, MTP, TRAP, assert_same_state, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
LAYERS = 3  # the MTP layer is model.layers.3
# Tokens are compared in float32, with the CPU_MLA backend, against the same speculative
# run with vLLM's own loader (FLOAT32_MTP, tests/support/canary.py, says why).


def mtp_model(root: Path) -> Path:
    return make_tiny_model(
        root / "model",
        "DeepseekV3ForCausalLM",
        num_hidden_layers=LAYERS,
        num_nextn_predict_layers=1,
    )


def test_mtp_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    model = mtp_model(tmp_path)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    draft = read_manifest(artifact).model("draft")
    assert (draft.method, draft.folder) == ("mtp", "draft")
    assert draft.shared_with_target == (f"model.layers.{LAYERS}.shared_head.head.weight",)
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "dump", dtype="bfloat16", speculative_config=MTP,
        allow_engine_failure=True,
    )  # fmt: skip
    shared = set(draft.shared_with_target)
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared=shared):
        state, ours = rank.state, rank.ours
        if rank.role == "draft":
            assert rank.meta["model_class"] == "DeepSeekMTP"
            assert "model.embed_tokens.weight" in ours
            assert any(".mtp_block.mlp.experts.routed_experts.w13_weight" in n for n in ours)
        else:
            assert not [n for n in ours if n.startswith(f"model.layers.{LAYERS}.")]
            if rank.pp == 0:  # V3's MLA with q_lora_rank; the routing bias stays float32
                fused = state["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
                bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
                assert (bias.dtype, fused.dtype) == (torch.float32, torch.bfloat16)
        assert_same_state(state, ours)


def test_mtp_speculates_through_sharded_fast_at_tp2_with_collectives_refused(
    tmp_path: Path,
) -> None:
    model = mtp_model(tmp_path)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1, dtype="float32"), progress=False)
    reference = vllm_env.generate(model, 2, 1, "auto", **FLOAT32_MTP)
    tokens = vllm_env.generate(
        artifact, 2, 1, "dump-sharded-fast", **FLOAT32_MTP,
        dump_dir=tmp_path / "dump", env=TRAP,
    )  # fmt: skip
    dumps = vllm_env.dump_files(tmp_path / "dump")
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    assert shared == {"model.embed_tokens.weight", f"model.layers.{LAYERS}.shared_head.head.weight"}
    # a draft's shared parameters are left unfilled: vLLM shares the target's next
    for rank in rank_dumps(dumps, artifact, tp=2, pp=1, draft=True, shared=shared):
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == []
        assert_same_state(rank.state, rank.ours)
    assert [len(seq) for seq in tokens] == [len(seq) for seq in reference] == [8, 8]
    assert tokens == reference

    # One more run: a tp2 x pp2 artifact served at tp2 x pp1, each rank cut out of it.
    finer = tmp_path / "tp2-pp2"
    convert(str(model), finer, Options(tp=2, pp=2, dtype="float32"), progress=False)
    regrouped = vllm_env.generate(
        finer, 2, 1, "dump-sharded-fast", **FLOAT32_MTP,
        dump_dir=tmp_path / "regrouped", env=TRAP,
    )  # fmt: skip
    assert regrouped == reference
    dumps = vllm_env.dump_files(tmp_path / "regrouped")
    for rank in rank_dumps(dumps, artifact, tp=2, pp=1, draft=True, shared=shared):
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == []
        if rank.role == "draft":
            assert rank.meta["model_class"] == "DeepSeekMTP"
        assert_same_state(rank.state, rank.ours)
