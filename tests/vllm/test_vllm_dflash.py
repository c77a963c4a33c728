"""DFlash drafts in a real vLLM (CPU build).

- tp2 x pp2, vLLM's default loader: every rank file (target and draft) equals what vLLM
  leaves in memory after loading, byte for byte, the mask embedding read from
  `mask_embedding.pt` included (the CPU engine fails after loading at pp > 1, which
  leaves the state complete).
- tp2 with `draft_tensor_parallel_size: 1`, through `sharded-fast` with every collective
  refused while each rank loads: speculative decoding gives the target's tokens, and the
  draft holds its rank files plus what vLLM's own `load_weights` sets besides them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import TRAP, assert_same_state, loaded, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model, write_mask_embedding
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
# The usual released DFlash draft: no embedding or lm_head of its own (vLLM shares the
# target's), a mask embedding in a side file.
SHARED = ("embed_tokens.weight", "lm_head.weight")
SIDE_EFFECTS = {"fused_kv_buffers": True, "has_separate_mask_embedding": True}


def dflash_pair(root: Path, arch: str, layers: int) -> tuple[Path, Path]:
    model = make_tiny_model(root / "model", arch, num_hidden_layers=layers)
    draft = make_tiny_draft(root / "draft", model, "dflash", omit=SHARED)
    write_mask_embedding(draft)
    return model, draft


def test_dflash_rank_files_equal_vllm_state_at_tp2_pp2(tmp_path: Path) -> None:
    # Six layers put the auxiliary layers (after 4, 5 and 6) on the last stage.
    model, draft = dflash_pair(tmp_path, "LlamaForCausalLM", 6)
    artifact = tmp_path / "artifact"
    convert(
        str(model), artifact, Options(tp=2, pp=2, draft=str(draft), dtype="float32"), progress=False
    )
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "dump", speculative_config=spec, allow_engine_failure=True
    )
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True):
        meta = rank.meta
        assert_same_state(loaded(rank.state, meta, shared), rank.ours)
        if rank.role == "draft":
            assert {k: meta[k] for k in SIDE_EFFECTS} == SIDE_EFFECTS
            assert (meta["has_own_embed_tokens"], meta["has_own_lm_head"]) == (False, False)


def test_dflash_speculates_through_sharded_fast_at_tp2_with_collectives_refused(
    tmp_path: Path,
) -> None:
    model, draft = dflash_pair(tmp_path, "Qwen3ForCausalLM", 4)
    artifact = tmp_path / "artifact"
    convert(
        str(model), artifact, Options(tp=2, pp=1, draft=str(draft), dtype="float32"), progress=False
    )
    spec = {
        "method": "dflash",
        "model": str(artifact / "draft"),
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": 1,
    }
    tokens = vllm_env.generate(
        artifact, 2, 1, "dump-sharded-fast", speculative_config=spec,
        dump_dir=tmp_path / "dump", env=TRAP,
    )  # fmt: skip
    assert tokens == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)
    dumps = vllm_env.dump_files(tmp_path / "dump")
    for rank in rank_dumps(dumps, artifact, tp=2, pp=1, draft=True):
        meta = rank.meta
        assert meta["collective_calls"] == []
        if rank.role == "draft":
            assert {k: meta[k] for k in SIDE_EFFECTS} == SIDE_EFFECTS
            shared = {"model.embed_tokens.weight", "lm_head.weight"}
            assert_same_state(loaded(rank.state, meta, shared), rank.ours)
