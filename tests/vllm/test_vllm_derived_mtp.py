"""The MTP draft of an architecture no family module names, derived from vLLM's own model
definition with its target (plan/derived), in a real vLLM (CPU build, bfloat16): GLM-4.7-
Flash (`Glm4MoeLiteForCausalLM`) converted at tp2 x pp2 with the MTP layer its checkpoint
carries. Every rank file of the target and of the draft (on the last stage only) equals
what vLLM's default loader leaves in memory with `--speculative-config '{"method":
"mtp"}'`, byte for byte, but the lm_head copy vLLM's proposer replaces with the target's;
`sharded-fast`, with every collective trapped, leaves the same state. The same for
Qwen3.5-MoE's text-only class (`Qwen3_5MoeForCausalLM`, its `Qwen3_5MoeMTP` draft) as
transformers saves it: each expert's projections apart, the DeltaNet's too. The CPU
engine fails after loading a draft at pp > 1, which leaves the state complete: one
default run and one sharded-fast run serve every check."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import MTP, TRAP, assert_same_dumps, assert_same_state, rank_dumps
from derived_mtp import GLM, LAYERS, QWEN35, make_mtp_model

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
HEAD = f"model.layers.{LAYERS}.shared_head.head.weight"
RUN = {"dtype": "bfloat16", "speculative_config": MTP, "allow_engine_failure": True}


def test_derived_mtp_draft_rank_files_equal_vllm_and_sharded_fast_leaves_them(
    tmp_path: Path,
) -> None:
    model = make_mtp_model(tmp_path / "model", GLM)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2, dtype="bfloat16"), progress=False)
    manifest = read_manifest(artifact)
    assert manifest.vllm_layout.revisions == {"derived": 1}
    assert manifest.vllm_layout.verified_with == ("0.32.0",)
    draft = manifest.model("draft")
    assert (draft.method, draft.folder, draft.shared_with_target) == ("mtp", "draft", (HEAD,))
    assert {(f.role, f.pp) for f in manifest.files if f.role == "draft"} == {("draft", 1)}

    default = vllm_env.dump_state(model, 2, 2, tmp_path / "default", **RUN)
    for rank in rank_dumps(default, artifact, tp=2, pp=2, draft=True, shared={HEAD}):
        if rank.role == "draft":
            assert rank.meta["model_class"] == "Glm4MoeLiteMTP"
            assert "model.embed_tokens.weight" in rank.ours  # its own, at pp > 1
            assert any(".mtp_block.mlp.experts.routed_experts.w13_weight" in n for n in rank.ours)
        else:
            assert not [n for n in rank.ours if n.startswith(f"model.layers.{LAYERS}.")]
        assert_same_state(rank.state, rank.ours)

    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast", env=TRAP, **RUN
    )
    leave_out = {("draft", 1, t): {HEAD} for t in range(2)}
    assert_same_dumps(fast, default, leave_out)


def test_qwen3_5_moe_text_rank_files_and_its_mtp_draft_equal_vllm_and_sharded_fast_leaves_them(
    tmp_path: Path,
) -> None:
    """Its classes import torchvision (vllm_env.with_torchvision); DeltaNet's prefix
    caching runs a Triton kernel when a draft speculates (off)."""
    model = make_mtp_model(tmp_path / "model", QWEN35)
    env = vllm_env.with_torchvision()
    artifact = tmp_path / "artifact"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", env["PYTHONPATH"])
        convert(str(model), artifact, Options(tp=2, pp=2, dtype="bfloat16"), progress=False)
    draft = read_manifest(artifact).model("draft")
    assert draft.shared_with_target == ("lm_head.weight",)
    run = RUN | {"engine": {"enable_prefix_caching": False}}
    default = vllm_env.dump_state(model, 2, 2, tmp_path / "default", env=env, **run)
    for rank in rank_dumps(default, artifact, tp=2, pp=2, draft=True, shared={"lm_head.weight"}):
        classes = {"target": QWEN35, "draft": "Qwen3_5MoeMTP"}
        assert rank.meta["model_class"] == classes[rank.role]
        assert any(".mlp.experts.routed_experts.w13_weight" in n for n in rank.ours)
        assert_same_state(rank.state, rank.ours)
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        env=vllm_env.with_torchvision(TRAP), **run,
    )  # fmt: skip
    leave_out = {("draft", 1, t): {"lm_head.weight"} for t in range(2)}
    assert_same_dumps(fast, default, leave_out)
