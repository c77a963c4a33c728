"""Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration` as published) and its MTP draft in a
real vLLM (CPU build). The draft is the `mtp.*` tensors inside the target checkpoint.

vLLM's Qwen3.5 classes import transformers' Qwen2-VL image processor, which imports
torchvision: these runs get torchvision's Python part (`vllm_env.with_torchvision`). The
tiny checkpoint gets a word-level tokenizer and processor configs (`tiny_processor.py`) so
that vLLM builds its multimodal processor and, with image prompts allowed, the tower.

- tp2 x pp2 in bfloat16, image prompts allowed, vLLM's default loader with the MTP draft:
  every rank file (target and draft) equals what vLLM leaves in memory, byte for byte: the
  DeltaNet's `in_proj_qkvz` fused from the separate `in_proj_qkv` and `in_proj_z` (the
  rank's q, k, v rows, then its z rows), `in_proj_ba`, `conv1d` as the rank's q, k and v
  rows, `A_log` float32, the experts from transformers 5's fused `gate_up_proj`, and the
  vision tower split by tp on both stages. The CPU engine fails after loading at pp > 1
  with a draft, which leaves the state complete.
- The same artifact served at tp1 x pp2 through `sharded-fast`, every collective refused
  while each rank loads, text only (`limit_mm_per_prompt` 0: vLLM leaves the tower
  unbuilt and its tensors are skipped): each rank, made of the tp2 ranks' blocks (the
  expert stacks' rows of each half, their columns), holds what a tp1 x pp2 conversion
  holds, but the tower.
- tp2, image prompts allowed, speculating with the MTP draft: vLLM's default loader and
  `sharded-fast` (collectives refused) leave each rank holding its files and give the
  same greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from canary import MTP, TRAP, assert_same_state, rank_dumps
from tiny_processor import add_qwen_vl_processor

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
QWEN35 = "Qwen3_5MoeForConditionalGeneration"
LAYERS = "language_model.model.layers."
TOWER = "visual."
# The processor needs the tokenizer; vLLM's DeltaNet on the CPU runs in bfloat16, and its
# prefix caching of DeltaNet state runs a Triton kernel when a draft speculates.
WITH_IMAGES = {"limit_mm_per_prompt": {"image": 1, "video": 0}, "skip_tokenizer_init": False}
TEXT_ONLY = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
RUN = {"dtype": "bfloat16", "speculative_config": MTP}


def qwen35_model(root: Path, stages: int) -> Path:
    """Two layers a stage (DeltaNet, then full attention), one MTP layer, a two-block
    tower, with a tokenizer and processor configs."""
    model = make_tiny_model(root / "model", QWEN35, num_hidden_layers=2 * stages)
    add_qwen_vl_processor(model)
    return model


def engine(mm: dict) -> dict:
    return mm | {"enable_prefix_caching": False}


def test_qwen3_5_moe_rank_files_equal_vllm_state_at_tp2_pp2_with_the_mtp_draft(
    tmp_path: Path,
) -> None:
    model = qwen35_model(tmp_path, stages=2)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=2), progress=False)
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "default", engine=engine(WITH_IMAGES),
        env=vllm_env.with_torchvision(), allow_engine_failure=True, **RUN,
    )  # fmt: skip
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True, shared=shared):
        (role, p, _), state, meta = rank.key, rank.state, rank.meta
        if role == "draft":
            assert meta["model_class"] == "Qwen3_5MoeMTP"
        else:
            assert meta["model_class"] == QWEN35
            linear, full = f"{LAYERS}{2 * p}.linear_attn.", f"{LAYERS}{2 * p + 1}.self_attn."
            # q, k (2 key heads of 128), v, z (4 value heads of 128): half of each a rank.
            assert tuple(state[linear + "in_proj_qkvz.weight"].shape) == (768, 128)
            assert tuple(state[linear + "conv1d.weight"].shape) == (512, 1, 4)
            assert state[linear + "A_log"].dtype == torch.float32
            assert tuple(state[full + "qkv_proj.weight"].shape) == ((2 * 4 + 2 * 2) * 32 // 2, 128)
            assert tuple(state[TOWER + "blocks.1.attn.qkv.weight"].shape) == (3 * 64 // 2, 64)
        assert_same_state(state, rank.ours)
    # The same artifact at tp1 x pp2, text only: each rank regroups its tensors from the
    # tp2 files, and skips the tower; what it holds is what a tp1 x pp2 conversion holds.
    tp1 = tmp_path / "tp1"
    convert(str(model), tp1, Options(tp=1, pp=2), progress=False)
    fast = vllm_env.dump_state(
        artifact, 1, 2, tmp_path / "fast", load_format="dump-sharded-fast",
        engine=engine(TEXT_ONLY), env=vllm_env.with_torchvision(TRAP),
        allow_engine_failure=True, **RUN,
    )  # fmt: skip
    for rank in rank_dumps(fast, tp1, tp=1, pp=2, draft=True, shared=shared):
        state, ours = rank.state, rank.ours
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == []
        assert not [name for name in state if name.startswith(TOWER)]
        assert any(name.startswith(TOWER) for name in ours) == (rank.role == "target")
        assert_same_state(state, {n: v for n, v in ours.items() if not n.startswith(TOWER)})


def test_qwen3_5_moe_mtp_speculates_through_sharded_fast_at_tp2_with_collectives_refused(
    tmp_path: Path,
) -> None:
    model = qwen35_model(tmp_path, stages=1)
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    runs = {}
    for loader, env in (("dump-default", {}), ("dump-sharded-fast", TRAP)):
        dump_dir = tmp_path / loader
        runs[loader] = vllm_env.generate(
            model if loader == "dump-default" else artifact, 2, 1, loader, dump_dir=dump_dir,
            engine=engine(WITH_IMAGES), env=vllm_env.with_torchvision(env), **RUN,
        )  # fmt: skip
        dumps = vllm_env.dump_files(dump_dir)
        for rank in rank_dumps(dumps, artifact, tp=2, pp=1, draft=True, shared=shared):
            state, meta = rank.state, rank.meta
            if loader == "dump-sharded-fast":
                assert meta["trap_armed"] and meta["collective_calls"] == []
            assert any(name.startswith(TOWER) for name in state) == (rank.role == "target")
            assert_same_state(state, rank.ours)
    assert [len(seq) for seq in runs["dump-default"]] == [8, 8]
    assert runs["dump-sharded-fast"] == runs["dump-default"]
