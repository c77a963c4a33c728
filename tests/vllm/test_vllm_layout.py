"""The heart of the converter's proof: for every rank, the parameters that vLLM's own
default loader leaves in memory (before processing) equal shardprep's rank files — same
names, shapes, dtypes and bytes, nothing missing, nothing extra."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import FLAGS, assert_same_state, loaded, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CASES = {
    # name: (architecture, tp, pp, config overrides, extra environment)
    "llama-tp1-vocab1000": ("LlamaForCausalLM", 1, 1, {}, {}),
    "mistral-tp2": ("MistralForCausalLM", 2, 1, {"vocab_size": 32001}, {}),
    "qwen2-pp2-5layers-tied": (
        "Qwen2ForCausalLM", 1, 2, {"num_hidden_layers": 5, "tie_word_embeddings": True}, {}
    ),
    "qwen3-tp2-pp2": ("Qwen3ForCausalLM", 2, 2, {}, {}),
    "llama-tp2-pp2-kv1-partition": (
        "LlamaForCausalLM", 2, 2,
        {"num_key_value_heads": 1, "num_hidden_layers": 5, "vocab_size": 1000},
        {"VLLM_PP_LAYER_PARTITION": "1,4"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_files_equal_vllm_default_loader_state(case: str, tmp_path: Path) -> None:
    arch, tp, pp, overrides, env = CASES[case]
    model = make_tiny_model(tmp_path / "model", arch, **overrides)
    partition = env.get("VLLM_PP_LAYER_PARTITION")
    artifact = tmp_path / "artifact"
    options = Options(tp=tp, pp=pp, partition=partition, dtype="float32")
    convert(str(model), artifact, options, progress=False)
    dumps = vllm_env.dump_state(
        model, tp, pp, tmp_path / "dump", env=env, allow_engine_failure=True
    )
    for rank in rank_dumps(dumps, artifact, tp=tp, pp=pp):
        assert_same_state(rank.state, rank.ours)


DRAFT_CASES = {
    # name: (method, tp, pp, target layers, draft config overrides)
    # Six layers put the EAGLE3 auxiliary layers 4, 5, 6 on the last stage (the CPU engine
    # passes no auxiliary states between stages); EAGLE-1 needs an odd layer count at
    # pp2, or vLLM itself fails with "Duplicate layer name" (docs/vllm-notes.md).
    "eagle3-tp2-pp2": ("eagle3", 2, 2, 6, {"eagle_aux_hidden_state_layer_ids": [4, 5, 6]}),
    "eagle-tp2-pp2": ("eagle", 2, 2, 5, {}),
}


@pytest.mark.parametrize("case", sorted(DRAFT_CASES))
def test_draft_rank_files_equal_vllm_draft_state(case: str, tmp_path: Path) -> None:
    """With pp > 1 the CPU engine loads every rank (draft included) and then fails before
    serving; the dumps are taken right after loading, so they are complete."""
    method, tp, pp, layers, overrides = DRAFT_CASES[case]
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=layers)
    draft = make_tiny_draft(tmp_path / "draft", model, method, **overrides)
    artifact = tmp_path / "artifact"
    options = Options(tp=tp, pp=pp, draft=str(draft), dtype="float32")
    convert(str(model), artifact, options, progress=False)
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 2}
    dumps = vllm_env.dump_state(
        model, tp, pp, tmp_path / "dump", speculative_config=spec, allow_engine_failure=True
    )
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    assert {key for key in dumps if key[0] == "draft"} == {("draft", pp - 1, t) for t in range(tp)}
    for rank in rank_dumps(dumps, artifact):
        assert_same_state(loaded(rank.state, rank.meta, shared), rank.ours)
    if method != "eagle3":
        return
    # The same engine loading the artifact through sharded-fast, target and draft (on the
    # last stage only), leaves exactly what the default loader left, flags included.
    spec["model"] = str(artifact / "draft")
    fast = vllm_env.dump_state(
        artifact, tp, pp, tmp_path / "dump-fast", speculative_config=spec,
        allow_engine_failure=True, load_format="dump-sharded-fast",
    )  # fmt: skip
    assert fast.keys() == dumps.keys()
    for rank in rank_dumps(fast):
        default_state, meta = vllm_env.read_dump(dumps[rank.key])
        assert [rank.meta[f] for f in FLAGS] == [meta[f] for f in FLAGS]
        assert_same_state(loaded(default_state, meta, shared), loaded(rank.state, meta, shared))
