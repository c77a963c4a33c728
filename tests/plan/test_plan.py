"""Planning is pure: these tests feed header dicts and never touch a file."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from plans import source_model

from shardprep.demo.tiny import tiny_config
from shardprep.errors import ConfigError, PlanError
from shardprep.format.headers import numel
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel


def source(config: dict[str, Any], dtype: str = "BF16", drop=(), extra=None) -> SourceModel:
    return source_model(config, dtype=dtype, dtypes={}, drop=drop, extra=extra)


def llama_405b() -> dict[str, Any]:
    return tiny_config(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        torch_dtype="bfloat16",
    )


def test_a_405b_model_plans_without_reading_a_byte() -> None:
    config = llama_405b()
    model = source(config)
    plan = make_plan(model, ConversionRequest(tp=8, pp=2))
    parts = {(f.pp, f.tp): f.part + 1 for f in plan.files}
    assert set(parts) == {(p, t) for p in range(2) for t in range(8)}
    assert min(parts.values()) > 1  # ~50 GB a rank in parts of at most 5 GiB
    source_bytes = sum(numel(s) * 2 for _, s in model.tensors.values())
    # 8 KV heads over 8 ranks and a vocabulary already a multiple of 64: every byte lands
    # exactly once, except the norms, which every rank of a stage holds.
    replicated = sum(numel(s) * 2 for n, (_, s) in model.tensors.items() if len(s) == 1)
    assert sum(f.nbytes for f in plan.files) == source_bytes + 7 * replicated
    assert all(f.nbytes <= 5 * 1024**3 for f in plan.files)


def test_stage_selection_and_layer_names_are_global() -> None:
    config = tiny_config(num_hidden_layers=5)
    plan = make_plan(source(config), ConversionRequest(tp=2, pp=2, stage=1))
    assert {f.pp for f in plan.files} == {1}
    names = {t.name for f in plan.files for t in f.tensors}
    assert "model.layers.3.self_attn.qkv_proj.weight" in names
    assert "model.layers.2.self_attn.qkv_proj.weight" not in names  # 5 layers -> 3,2
    assert {"model.norm.weight", "lm_head.weight"} <= names
    assert "model.embed_tokens.weight" not in names


def test_fused_qkv_with_replicated_kv_heads() -> None:
    config = tiny_config(num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    plan = make_plan(source(config), ConversionRequest(tp=4, pp=1))
    qkv = {
        f.tp: next(t for t in f.tensors if t.name == "model.layers.0.self_attn.qkv_proj.weight")
        for f in plan.files
    }
    for rank, tensor in qkv.items():
        assert tensor.shape == (16 + 16 + 16, 128)
        q, k, v = tensor.blocks
        assert q.rows == (16 * rank, 16 * (rank + 1))
        assert k.rows == v.rows == (0, 16)


def test_tied_embeddings_on_first_and_last_stage_only_once() -> None:
    config = tiny_config(tie_word_embeddings=True)
    plan = make_plan(source(config), ConversionRequest(tp=1, pp=2))
    by_stage = {f.pp: {t.name for t in f.tensors} for f in plan.files}
    assert "model.embed_tokens.weight" in by_stage[0] and "model.embed_tokens.weight" in by_stage[1]
    assert "lm_head.weight" not in by_stage[1]
    one_stage = make_plan(source(config), ConversionRequest(tp=1, pp=1))
    names = [t.name for t in one_stage.files[0].tensors]
    assert names.count("model.embed_tokens.weight") == 1


def test_draft_lives_on_the_last_stage_and_target_embedding_joins_it() -> None:
    config = tiny_config()
    draft_config = {**config, "num_hidden_layers": 1, "draft_vocab_size": 512}
    draft = source_model(
        draft_config, archs.draft_family("eagle3", "llama"), dtype="F32", dtypes={},
        extra={"d2t": ("I64", (512,)), "t2d": ("BOOL", (1000,))}, target_config=config,
    )  # fmt: skip
    plan = make_plan(source(config, "F32"), ConversionRequest(tp=2, pp=2), draft)
    draft_files = [f for f in plan.files if f.role == "draft"]
    assert {(f.pp, f.tp) for f in draft_files} == {(1, 0), (1, 1)}
    assert all(f.path.startswith("draft/shards/model-pp-1-tp-") for f in draft_files)
    last_target = next(f for f in plan.files if f.role == "target" and f.pp == 1)
    assert "model.embed_tokens.weight" in {t.name for t in last_target.tensors}
    target = next(m for m in plan.models if m.role == "target")
    assert target.spec_decode_only == (("model.embed_tokens.weight", 1),)
    d2t = next(t for t in draft_files[0].tensors if t.name == "draft_id_to_target_id")
    assert d2t.dtype == "I64"
    assert ("t2d", "vLLM does not use the target-to-draft table") in plan.models[1].skipped


def test_shuffled_source_order_gives_the_same_plan() -> None:
    config = tiny_config()
    model = source(config)
    shuffled = SourceModel(config, dict(reversed(list(model.tensors.items()))))
    assert make_plan(model, ConversionRequest(tp=2, pp=2)) == make_plan(
        shuffled, ConversionRequest(tp=2, pp=2)
    )


def test_max_part_size_splits_between_tensors() -> None:
    plan = make_plan(source(tiny_config()), ConversionRequest(tp=1, pp=1, max_part_bytes=50_000))
    assert len(plan.files) > 3
    assert [f.part for f in plan.files] == list(range(len(plan.files)))
    assert all(f.nbytes <= 50_000 or len(f.tensors) == 1 for f in plan.files)


def test_all_problems_are_reported_at_once() -> None:
    config = tiny_config(num_attention_heads=4, intermediate_size=130, vocab_size=1000)
    model = source(
        config,
        drop={"model.layers.1.mlp.up_proj.weight"},
        extra={"model.layers.0.mlp.experts.0.w1": ("BF16", (4, 4))},
    )
    with pytest.raises(PlanError) as info:
        make_plan(model, ConversionRequest(tp=3, pp=2))
    message = str(info.value)
    assert "num_attention_heads (4) is not divisible by tp=3" in message
    assert "intermediate_size (130) is not divisible by tp=3" in message
    assert "1 tensor(s) that config.json implies are missing: model.layers.1.mlp.up_proj" in message
    assert "that shardprep does not know where to put: model.layers.0.mlp.experts.0.w1" in message


def test_shape_that_contradicts_config() -> None:
    config = tiny_config()
    model = source(config, extra={"model.layers.2.self_attn.q_proj.weight": ("BF16", (32, 128))})
    with pytest.raises(
        PlanError,
        match=r"q_proj.weight has shape \[32, 128\] but config.json "
        r"implies \[128, 128\]",
    ):
        make_plan(model, ConversionRequest(tp=1, pp=1))


def test_padded_vocab_not_divisible() -> None:
    with pytest.raises(
        PlanError, match=r"vocabulary padded to 64 \(1024\) is not divisible by tp=3"
    ):
        make_plan(
            source(
                tiny_config(
                    num_attention_heads=3, num_key_value_heads=3, head_dim=16, intermediate_size=129
                )
            ),
            ConversionRequest(tp=3, pp=1),
        )


def test_unsupported_architecture_names_the_supported_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without vLLM (whose model definitions derive a layout for any architecture it
    registers), an architecture no family names is one line: the families, what to install."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    config = tiny_config()
    config["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no shardprep family") as info:
        make_plan(SourceModel(config, {}), ConversionRequest(tp=1, pp=1))
    message = str(info.value)
    assert message.endswith("model definition: pip install shardprep[vllm]")
    supported = message.split("family (")[1].split(" do)")[0].split(", ")
    assert supported == sorted(supported)
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"} <= set(supported)


def test_partition_that_does_not_sum() -> None:
    with pytest.raises(PlanError, match="sums to 5 but the model has 4 layers"):
        make_plan(source(tiny_config()), ConversionRequest(tp=1, pp=2, partition="3,2"))


def test_dtype_resolution() -> None:
    config = tiny_config(torch_dtype="bfloat16")
    plan = make_plan(source(config, "F32"), ConversionRequest(tp=1, pp=1))
    assert {t.dtype for f in plan.files for t in f.tensors} == {"BF16"}
    plan = make_plan(source(config), ConversionRequest(tp=1, pp=1, dtype="float32"))
    assert {t.dtype for f in plan.files for t in f.tensors} == {"F32"}
    float32 = tiny_config(torch_dtype="float32")  # vLLM's auto serves float32 as bfloat16
    assert (
        make_plan(source(float32, "F32"), ConversionRequest(tp=1, pp=1)).models[0].dtype == "BF16"
    )
    with pytest.raises(ConfigError, match="dtype 'int4' is not supported"):
        make_plan(source(config), ConversionRequest(tp=1, pp=1, dtype="int4"))
