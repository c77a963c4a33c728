"""Mixture-of-experts families and expert parallelism, planned from header dicts only."""

from __future__ import annotations

from typing import Any

import pytest
from plans import source_model

from shardprep.demo.tiny import tiny_config
from shardprep.errors import PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"


def source(config: dict[str, Any], drop: tuple[str, ...] = ()) -> SourceModel:
    return source_model(config, dtypes={}, drop=drop)


def tensors_of(plan: Plan, pp: int, tp: int) -> dict[str, Any]:
    return {t.name: t for f in plan.files if (f.pp, f.tp) == (pp, tp) for t in f.tensors}


def test_qwen3_moe_mixes_dense_and_sparse_layers_as_vllm_does() -> None:
    # decoder_sparse_step 2: layers 1, 3, 5 are sparse; mlp_only_layers takes 3 back.
    config = tiny_config(QWEN3_MOE, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    plan = make_plan(source(config), ConversionRequest(tp=2, pp=2))
    names = {t for pp in range(2) for t in tensors_of(plan, pp, 1)}
    sparse = {i for i in range(6) if f"model.layers.{i}.mlp.gate.weight" in names}
    dense = {i for i in range(6) if f"model.layers.{i}.mlp.gate_up_proj.weight" in names}
    assert (sparse, dense) == ({1, 5}, {0, 2, 3, 4})
    w13 = tensors_of(plan, 0, 1)["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert (w13.shape, w13.stacked_shape) == ((8, 64, 128), (512, 128))
    # Expert 5 of rank 1: its gate's second half, then its up's second half.
    assert w13.blocks[10].source == "model.layers.1.mlp.experts.5.gate_proj.weight"
    assert [b.rows for b in w13.blocks[10:12]] == [(32, 64), (32, 64)]
    w2 = tensors_of(plan, 0, 1)["model.layers.1.mlp.experts.routed_experts.w2_weight"]
    assert (w2.shape, w2.blocks[0].cols) == ((8, 128, 32), (32, 64))


@pytest.mark.parametrize("arch", [QWEN3_MOE, MIXTRAL])
def test_embedding_norm_and_lm_head_on_every_stage(arch: str) -> None:
    plan = make_plan(source(tiny_config(arch, num_hidden_layers=3)), ConversionRequest(tp=1, pp=3))
    for stage in range(3):
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(
            tensors_of(plan, stage, 0)
        )


def test_mixtral_names_its_experts_w1_w3_w2() -> None:
    plan = make_plan(source(tiny_config(MIXTRAL)), ConversionRequest(tp=2, pp=1))
    tensors = tensors_of(plan, 0, 0)
    w13 = tensors["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"]
    assert [b.source for b in w13.blocks[:2]] == [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w3.weight",
    ]
    assert w13.shape == (8, 128, 128)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (8, 128)


def test_a_missing_expert_is_one_clear_error() -> None:
    config = tiny_config(MIXTRAL)
    missing = "model.layers.2.block_sparse_moe.experts.7.w3.weight"
    with pytest.raises(PlanError) as info:
        make_plan(source(config, drop=(missing,)), ConversionRequest(tp=2, pp=1))
    assert str(info.value) == (
        "cannot convert: target: 1 tensor(s) that config.json implies are missing: " + missing
    )


def test_expert_intermediate_size_must_divide() -> None:
    config = tiny_config(QWEN3_MOE, moe_intermediate_size=36)
    with pytest.raises(PlanError, match=r"intermediate size \(36\) is not divisible by tp x dp"):
        make_plan(source(config), ConversionRequest(tp=8, pp=1))


def test_expert_parallel_gives_each_rank_whole_experts_remainder_first() -> None:
    config = tiny_config(QWEN3_MOE, num_experts=7)
    plan = make_plan(source(config), ConversionRequest(tp=2, pp=1, expert_parallel=True))
    name = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    stacks = [tensors_of(plan, 0, tp)[name] for tp in range(2)]
    assert [s.shape for s in stacks] == [(4, 128, 128), (3, 128, 128)]
    assert [b.source.split(".")[5] for b in stacks[1].blocks] == ["4", "4", "5", "5", "6", "6"]
    assert all(b.rows == (0, 64) for s in stacks for b in s.blocks)
    # Everything else is cut by tp as without expert parallelism.
    dense = make_plan(source(config), ConversionRequest(tp=2, pp=1))
    assert tensors_of(plan, 0, 1)["lm_head.weight"] == tensors_of(dense, 0, 1)["lm_head.weight"]
    experts = plan.models[0].experts
    assert experts is not None and experts.rank_experts == ((0, 1, 2, 3), (4, 5, 6))


def test_round_robin_falls_back_to_linear_without_grouped_routing() -> None:
    config = tiny_config(MIXTRAL)
    plan = make_plan(
        source(config),
        ConversionRequest(tp=2, pp=1, expert_parallel=True, expert_placement="round_robin"),
    )
    experts = plan.models[0].experts
    assert experts is not None
    assert (experts.requested_placement, experts.split.placement) == ("round_robin", "linear")
    assert experts.rank_experts == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_round_robin_holds_for_deepseek_grouped_routing() -> None:
    """DeepSeek-V3 routes in n_group groups: vLLM places its experts round robin (its MTP
    layer's too: tests/plan/test_derived_expert_parallel.py shows vLLM doing it)."""
    config = tiny_config("DeepseekV3ForCausalLM")
    assert config["n_group"] == 2
    request = ConversionRequest(tp=2, pp=1, expert_parallel=True, expert_placement="round_robin")
    experts = make_plan(source_model(config), request).models[0].experts
    assert experts is not None and experts.split.placement == "round_robin"
    assert experts.rank_experts == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_expert_parallel_bad_input() -> None:
    with pytest.raises(PlanError, match="--enable-expert-parallel needs a mixture-of-experts"):
        make_plan(source(tiny_config()), ConversionRequest(tp=2, pp=1, expert_parallel=True))
    config = tiny_config(MIXTRAL, num_local_experts=3, num_attention_heads=4)
    with pytest.raises(PlanError, match="over tp x dp = 4 ranks needs at least 4 experts"):
        make_plan(source(config), ConversionRequest(tp=4, pp=1, expert_parallel=True))
    with pytest.raises(PlanError, match="expert placement 'random' is unknown"):
        make_plan(source(config), ConversionRequest(tp=1, pp=1, expert_placement="random"))


def test_moe_manifest_records_experts_and_matches_the_schema(tmp_path) -> None:
    import json

    import jsonschema
    from safetensors import safe_open
    from schema import SCHEMA

    from shardprep.convert.run import Options, convert
    from shardprep.convert.verify import verify
    from shardprep.demo.tiny import make_tiny_model
    from shardprep.format.manifest import parse_manifest, read_manifest

    model = make_tiny_model(tmp_path / "model", MIXTRAL, num_local_experts=5, num_hidden_layers=2)
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1, expert_parallel=True), progress=False)
    jsonschema.validate(json.loads((out / "shardprep.json").read_text()), SCHEMA)
    manifest = read_manifest(out)
    assert parse_manifest(manifest.to_json()) == manifest
    assert manifest.topology.expert_parallel
    experts = manifest.model("target").experts
    assert experts is not None
    assert experts.rank_experts == ((0, 1, 2), (3, 4))
    assert experts.assumptions == {
        "moe_intermediate_padding": "none",
        "fused_shared_experts": "none",
    }
    result = verify(out, full=True, progress=False)
    with safe_open(str(model / "model.safetensors"), "pt") as source_file:
        assert (result.problems, result.round_trip_tensors) == ([], len(source_file.keys()))
