"""Kimi-K2.5 / K2.6 (`KimiK25ForConditionalGeneration`) in a real vLLM (CPU build).

One tiny checkpoint in the published naming (DeepSeek-V3's text model under
`language_model.`, a MoonViT of two blocks under `vision_tower.`, the projector's
`mm_projector.proj.0/2`), image and video prompts off (`limit_mm_per_prompt` 0: vLLM
still builds the tower, which serves the `vision_chunk` modality), at tp2 x pp2:

- every rank file equals what vLLM's default loader leaves in memory, byte for byte: the
  text model split as DeepSeek-V3's, the fused `wqkv` as q, k and v rows of the rank,
  `wo` and `mlp.fc1` by columns, `mlp.fc0` by rows, the projector as `linear_1/2`, whole;
  the vision tower and projector on BOTH pipeline stages, as vLLM builds them;
- `sharded-fast`, with every collective refused while each rank loads, leaves the same
  state and gives the default loader's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import TRAP, assert_same_dumps, assert_same_state, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
KIMI = "KimiK25ForConditionalGeneration"
ENGINE = {
    "attention_config": {"backend": "CPU_MLA"},
    "limit_mm_per_prompt": {"image": 0, "video": 0},
}
BLOCK = "vision_tower.encoder.blocks.1."


def test_kimi_k25_rank_files_and_tokens_equal_vllm_at_tp2_pp2(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", KIMI, num_hidden_layers=3)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2, dtype="float32"), progress=False)
    run = {"max_tokens": 6, "engine": ENGINE}
    default = vllm_env.generate(model, 2, 2, "dump-default", dump_dir=tmp_path / "default", **run)
    dumps = vllm_env.dump_files(tmp_path / "default")
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2):
        state, p = rank.state, rank.pp
        assert rank.meta["model_class"] == KIMI
        # The tower (hidden 64, 4 heads) split by tp on every stage; the projector whole.
        assert tuple(state[BLOCK + "wqkv.weight"].shape) == (3 * 64 // 2, 64)
        assert tuple(state[BLOCK + "wo.weight"].shape) == (64, 64 // 2)
        assert tuple(state[BLOCK + "mlp.fc0.weight"].shape) == (128 // 2, 64)
        assert tuple(state["mm_projector.linear_1.weight"].shape) == (256, 256)
        assert tuple(state["mm_projector.linear_2.weight"].shape) == (128, 256)
        assert state["mm_projector.pre_norm.bias"].dtype == torch.float32
        text = "language_model.model.embed_tokens.weight"
        assert (text in state) == (p == 0)
        assert ("language_model.lm_head.weight" in state) == (p == 1)
        assert_same_state(state, rank.ours)
    fast = vllm_env.generate(
        artifact, 2, 2, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP, **run
    )
    assert all(len(seq) == 6 for seq in default)
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), dumps)
