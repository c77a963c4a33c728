"""GLM-4.5 (`Glm4MoeForCausalLM`) and its MTP draft in a real vLLM (CPU build). The draft
is the MTP layer inside the target checkpoint; vLLM is given no draft path.

- tp2 x pp2 in bfloat16, vLLM's default loader with the MTP draft: every rank file
  (target and draft) equals what vLLM leaves in memory after loading, byte for byte: the
  router and its bias float32 from a bfloat16 checkpoint, `qkv_proj` with its bias, q/k
  norms, a dense first layer and shared experts (the CPU engine fails after loading at
  pp > 1, which leaves the state complete). At pp > 1 the draft holds its own embedding.
- tp2 in float32, speculating with the MTP draft through `sharded-fast`, with every
  collective refused while each rank loads: each rank holds its rank files, and the
  tokens are transformers' own greedy tokens. The draft's vocab head (loaded from
  lm_head.weight) and, at pp = 1, its embedding, which vLLM replaces with the target's
  right after loading, are the only parameters the files leave out.
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
GLM = "Glm4MoeForCausalLM"
LAYERS = 3  # the MTP layer is model.layers.3
HEAD = f"model.layers.{LAYERS}.shared_head.head.weight"


def glm_model(root: Path) -> Path:
    return make_tiny_model(
        root / "model", GLM, num_hidden_layers=LAYERS, num_nextn_predict_layers=1
    )


def test_glm_rank_files_equal_vllm_state_at_tp2_pp2_with_the_mtp_draft(tmp_path: Path) -> None:
    model = glm_model(tmp_path)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    draft = read_manifest(artifact).model("draft")
    assert (draft.method, draft.folder, draft.shared_with_target) == ("mtp", "draft", (HEAD,))
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "dump", dtype="bfloat16", speculative_config=MTP,
        allow_engine_failure=True,
    )  # fmt: skip
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared={HEAD}):
        state, ours = rank.state, rank.ours
        if rank.role == "draft":
            assert rank.meta["model_class"] == "Glm4MoeMTP"
            assert "model.embed_tokens.weight" in ours
            block = f"model.layers.{LAYERS}.mtp_block."
            assert ours[block + "mlp.gate.weight"].dtype == torch.float32
        else:
            assert not [n for n in ours if n.startswith(f"model.layers.{LAYERS}.")]
            if rank.pp == 0:  # layer 0 dense, layer 1 with experts: router float32, qkv bias
                router = state["model.layers.1.mlp.gate.weight"]
                bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
                qkv_bias = state["model.layers.0.self_attn.qkv_proj.bias"]
                assert (router.dtype, bias.dtype) == (torch.float32, torch.float32)
                assert qkv_bias.dtype == torch.bfloat16
                assert "model.layers.0.mlp.gate_up_proj.weight" in state
        assert_same_state(state, ours)


def test_glm_mtp_speculates_through_sharded_fast_at_tp2_with_collectives_refused(
    tmp_path: Path,
) -> None:
    model = glm_model(tmp_path)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1, dtype="float32"), progress=False)
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    assert shared == {"model.embed_tokens.weight", HEAD}
    tokens = vllm_env.generate(
        artifact, 2, 1, "dump-sharded-fast", speculative_config=MTP, dtype="float32",
        dump_dir=tmp_path / "fast", env=TRAP,
    )  # fmt: skip
    fast = vllm_env.dump_files(tmp_path / "fast")
    # a draft's shared parameters are left unfilled: vLLM shares the target's next
    for rank in rank_dumps(fast, artifact, tp=2, pp=1, draft=True, shared=shared):
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == []
        assert_same_state(rank.state, rank.ours)
    assert [len(seq) for seq in tokens] == [8, 8]
    assert tokens == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)
