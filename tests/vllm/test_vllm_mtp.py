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
from test_vllm_layout import assert_same_state, rank_tensors

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
MTP = {"method": "mtp", "num_speculative_tokens": 1}
LAYERS = 3  # the MTP layer is model.layers.3
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


def mtp_model(root: Path) -> Path:
    return make_tiny_model(
        root / "model",
        "DeepseekV3ForCausalLM",
        num_hidden_layers=LAYERS,
        num_nextn_predict_layers=1,
    )


def without(state: dict, names: set[str]) -> dict:
    return {name: value for name, value in state.items() if name not in names}


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
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 2, with_draft=True))
    for (role, p, t), path in dumps.items():
        state, meta = vllm_env.read_dump(path)
        ours = rank_tensors(artifact, role, p, t)
        if role == "draft":
            assert meta["model_class"] == "DeepSeekMTP"
            assert "model.embed_tokens.weight" in ours
            assert any(".mtp_block.mlp.experts.routed_experts.w13_weight" in n for n in ours)
            state = without(state, set(draft.shared_with_target))
        else:
            assert not [n for n in ours if n.startswith(f"model.layers.{LAYERS}.")]
            if p == 0:  # V3's MLA with q_lora_rank; the routing bias stays float32
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
        dump_dir=tmp_path / "dump", env={"SHARDPREP_TRAP_COLLECTIVES": "1"},
    )  # fmt: skip
    dumps = vllm_env.dump_files(tmp_path / "dump")
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 1, with_draft=True))
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    assert shared == {"model.embed_tokens.weight", f"model.layers.{LAYERS}.shared_head.head.weight"}
    for (role, p, t), path in dumps.items():
        state, meta = vllm_env.read_dump(path)
        assert meta["trap_armed"] and meta["collective_calls"] == []
        if role == "draft":
            state = without(state, shared)  # left unfilled: vLLM shares the target's next
        assert_same_state(state, rank_tensors(artifact, role, p, t))
    assert [len(seq) for seq in tokens] == [len(seq) for seq in reference] == [8, 8]
    assert tokens == reference

    # One more run: a tp2 x pp2 artifact served at tp2 x pp1, each rank cut out of it.
    finer = tmp_path / "tp2-pp2"
    convert(str(model), finer, Options(tp=2, pp=2, dtype="float32"), progress=False)
    regrouped = vllm_env.generate(
        finer, 2, 1, "dump-sharded-fast", **FLOAT32_MTP,
        dump_dir=tmp_path / "regrouped", env={"SHARDPREP_TRAP_COLLECTIVES": "1"},
    )  # fmt: skip
    assert regrouped == reference
    dumps = vllm_env.dump_files(tmp_path / "regrouped")
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(2, 1, with_draft=True))
    for (role, p, t), path in dumps.items():
        state, meta = vllm_env.read_dump(path)
        assert meta["trap_armed"] and meta["collective_calls"] == []
        ours = rank_tensors(artifact, role, p, t)
        if role == "draft":
            assert meta["model_class"] == "DeepSeekMTP"
            state = without(state, shared)
        assert_same_state(state, ours)
