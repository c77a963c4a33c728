"""DeepSeek-V4's built-in DSpark draft, tested on bytes.

vLLM's CPU build cannot build the draft (`models/deepseek_v4/cpu/dspark.py` raises; the
NVIDIA class it would need creates `torch.cuda.Event`s in `DeepseekV4Attention.__init__`),
so no vLLM state exists here to compare with. These tests hold the rank files to the rules
read from `DSparkDeepseekV4ForCausalLM.load_weights` (`models/deepseek_v4/nvidia/dspark.py`):

- names: vLLM's own `_duplicate_context_wkv_weights`, `_remap_dspark_name` and
  `RoutedExperts.build_expert_params_mapping`, with the stacked-parameter table and the
  renames `load_weights` applies (`shared_experts.w2` -> `down_proj`, `gate.bias` ->
  `e_score_correction_bias`), run over the checkpoint's names, give exactly the names of
  the draft's rank files plus the embedding and lm_head it aliases from the target;
- bytes: each rank tensor is what the weight loaders make of the source tensors:
  `fused_wqa_wkv` = [wq_a; wkv] (replicated), `context_wkv_proj` = every stage's `wkv`
  stacked in stage order (shard_id = stage), column-parallel rows (`wq_b`, `wo_a`) and
  row-parallel columns (`wo_b`, `down_proj`) of rank t, `attn_sink[heads of t]` (float32),
  `gate_up_proj` = [w1 rows of t; w3 rows of t], expert stacks as FusedMoE's, the Markov
  `markov_w2` zero-padded to 64 rows and not split, the confidence head cast to float32;
  everything on the last stage only, at any pp (vLLM builds the draft with pp = 1 and
  loads it on the last stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model, tiny_config
from shardprep.errors import ConfigError, PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel, TensorPlan

V4 = "DeepseekV4ForCausalLM"
# load_weights' (param_name, ckpt_shard_name, shard_id) for decoder-layer names
STACKED = [
    ("gate_up_proj", "w1", 0),
    ("gate_up_proj", "w3", 1),
    ("attn.fused_wqa_wkv", "attn.wq_a", 0),
    ("attn.fused_wqa_wkv", "attn.wkv", 1),
]


def tensors_of(config: dict[str, Any], families: list) -> dict[str, tuple[str, tuple[int, ...]]]:
    found = {}
    for family in families:
        dtypes = family.source_dtypes(config)
        shapes = family.expected_shapes(config)
        found |= {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()}
    return found


def v4_source(config: dict[str, Any]) -> SourceModel:
    families = [archs.target_family(config)[1], archs.draft_family("dspark", "deepseek_v4")]
    return SourceModel(config, tensors_of(config, families))


def rank(plan: Plan, role: str, pp: int, tp: int) -> dict[str, TensorPlan]:
    return {
        t.name: t for f in plan.files if (f.role, f.pp, f.tp) == (role, pp, tp) for t in f.tensors
    }


def vllm_param_names(names: list[str], experts: int, confidence: bool = True) -> set[str]:
    """The parameters `DSparkDeepseekV4ForCausalLM.load_weights` fills from these names."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.models.deepseek_v4.nvidia.dspark import (
        DSparkDeepseekV4ForCausalLM,
        _duplicate_context_wkv_weights,
    )

    stages = len({n.split(".")[1] for n in names if n.startswith("mtp.")})
    model = SimpleNamespace(model=SimpleNamespace(confidence_head=object() if confidence else None))
    mapping = RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", experts)
    weights = [(n, torch.empty(0)) for n in names]
    found = set()
    for name, _ in _duplicate_context_wkv_weights(weights, stages):
        mapped = DSparkDeepseekV4ForCausalLM._remap_dspark_name(model, name)  # type: ignore[arg-type]
        if mapped is None:
            continue
        mapped = mapped.replace(".shared_experts.w2", ".shared_experts.down_proj")
        if ".experts." in mapped:
            param = next(mapped.replace(w, p) for p, w, _, _ in mapping if w in mapped)
            found.add(param)
            continue
        stacked = [
            mapped.replace(w, p)
            for p, w, _ in STACKED
            if mapped.startswith("model.layers.") and w in mapped
        ]
        mapped = stacked[0] if stacked else mapped
        found.add(mapped.replace(".ffn.gate.bias", ".ffn.gate.e_score_correction_bias"))
    return found


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny V4 with its two-stage DSpark draft, converted at tp2 x pp2."""
    root = tmp_path_factory.mktemp("v4dspark")
    model = make_tiny_model(root / "m", V4)
    convert(str(model), root / "a", Options(tp=2, pp=2), progress=False)
    return model, root / "a"


def draft_files(artifact: Path) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    manifest = read_manifest(artifact)
    found: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for f in manifest.files:
        if f.role == "draft":
            found.setdefault((f.pp, f.tp), {}).update(load_file(artifact / f.path))
    return found


@pytest.mark.vllm  # imports vLLM's DeepSeek-V4 DSpark module in this process
def test_the_rank_files_hold_the_parameters_vllm_s_load_weights_fills(
    tiny: tuple[Path, Path],
) -> None:
    pytest.importorskip("vllm")
    model, artifact = tiny
    names = sorted(load_file(model / "model.safetensors"))
    manifest = read_manifest(artifact)
    draft = manifest.model("draft")
    assert draft is not None and draft.method == "dspark"
    assert "deepseek_v4_dspark" in manifest.vllm_layout.revisions
    assert set(draft.shared_with_target) == {"model.embed_tokens.weight", "lm_head.weight"}
    files = draft_files(artifact)
    assert sorted(files) == [(1, 0), (1, 1)]  # the last stage only
    expected = vllm_param_names(names, experts=4)
    for state in files.values():
        assert set(state) == expected
    # nothing of the target in the draft's files, nothing of the draft in the target's
    target = {n for f in manifest.files if f.role == "target" for n in load_file(artifact / f.path)}
    assert "model.main_proj.weight" not in target and "model.context_wkv_proj.weight" not in target
    # at pp > 1 the NVIDIA target builds its embedding on the last stage for the draft
    # (`spec_decode_needs_target_embed`); a run without the draft skips it there
    target_entry = manifest.model("target")
    assert target_entry is not None
    assert list(target_entry.spec_decode_only) == [("model.embed_tokens.weight", 1)]
    assert "model.embed_tokens.weight" in target_entry.rank_params(1, 0)


def test_every_draft_tensor_is_what_the_weight_loaders_make_of_the_source(
    tiny: tuple[Path, Path],
) -> None:
    model, artifact = tiny
    src = load_file(model / "model.safetensors")
    for (_, t), state in draft_files(artifact).items():
        for i in (0, 1):
            s, p = f"mtp.{i}.", f"model.layers.{i}."
            a = p + "attn."
            assert torch.equal(
                state[a + "fused_wqa_wkv.weight"],
                torch.cat([src[s + "attn.wq_a.weight"], src[s + "attn.wkv.weight"]]),
            )
            assert torch.equal(state[a + "wq_b.weight"], src[s + "attn.wq_b.weight"].chunk(2)[t])
            assert torch.equal(state[a + "wo_a.weight"], src[s + "attn.wo_a.weight"].chunk(2)[t])
            assert torch.equal(
                state[a + "wo_b.weight"], src[s + "attn.wo_b.weight"].chunk(2, dim=1)[t]
            )
            sink = state[a + "attn_sink"]
            assert sink.dtype == torch.float32
            assert torch.equal(sink, src[s + "attn.attn_sink"][2 * t : 2 * t + 2])
            assert not any(".compressor." in n or ".indexer." in n for n in state)  # ratio 1
            f = p + "ffn."
            assert torch.equal(
                state[f + "shared_experts.gate_up_proj.weight"],
                torch.cat(
                    [
                        src[s + "ffn.shared_experts.w1.weight"].chunk(2)[t],
                        src[s + "ffn.shared_experts.w3.weight"].chunk(2)[t],
                    ]
                ),
            )
            assert torch.equal(
                state[f + "shared_experts.down_proj.weight"],
                src[s + "ffn.shared_experts.w2.weight"].chunk(2, dim=1)[t],
            )
            bias = state[f + "gate.e_score_correction_bias"]
            assert bias.dtype == torch.float32 and torch.equal(bias, src[s + "ffn.gate.bias"])
            assert f + "gate.tid2eid" not in state  # layers L + i route by score
            w13, w2 = (
                state[f + "experts.routed_experts." + n] for n in ("w13_weight", "w2_weight")
            )
            for e in range(4):
                x = f"{s}ffn.experts.{e}."
                gate_up = [src[x + "w1.weight"].chunk(2)[t], src[x + "w3.weight"].chunk(2)[t]]
                assert torch.equal(w13[e], torch.cat(gate_up))
                assert torch.equal(w2[e], src[x + "w2.weight"].chunk(2, dim=1)[t])
            for name in ("hc_attn_fn", "hc_ffn_base", "attn_norm.weight"):
                assert torch.equal(state[p + name], src[s + name])
        context = torch.cat([src["mtp.0.attn.wkv.weight"], src["mtp.1.attn.wkv.weight"]])
        assert torch.equal(state["model.context_wkv_proj.weight"], context)
        for rest in ("main_proj.weight", "main_norm.weight"):
            assert torch.equal(state[f"model.{rest}"], src[f"mtp.0.{rest}"])
        for rest in ("norm.weight", "hc_head_fn", "hc_head_scale", "markov_head.markov_w1.weight"):
            assert torch.equal(state[f"model.{rest}"], src[f"mtp.1.{rest}"])
        assert state["model.hc_head_fn"].dtype == torch.float32
        w2m = state["model.markov_head.markov_w2.weight"]  # 1000 rows padded to 1024
        assert w2m.shape == (1024, 16) and torch.equal(
            w2m[:1000], src["mtp.1.markov_head.markov_w2.weight"]
        )
        assert not w2m[1000:].any()
        confidence = state["model.confidence_head.proj.weight"]
        assert confidence.dtype == torch.float32
        assert torch.equal(confidence, src["mtp.1.confidence_head.proj.weight"].float())


def test_a_draft_without_a_confidence_head_leaves_it_out() -> None:
    config = tiny_config(V4, num_hidden_layers=2, compress_ratios=[0, 4])
    source = v4_source(config)
    tensors = {n: v for n, v in source.tensors.items() if "confidence_head" not in n}
    model = SourceModel(config, tensors)
    plan = make_plan(model, ConversionRequest(tp=2, pp=1, draft_method="dspark"), model)
    assert "model.confidence_head.proj.weight" not in rank(plan, "draft", 0, 0)
    family = archs.draft_family("dspark", "deepseek_v4")
    inner = torch.nn.Module()
    inner.confidence_head = torch.nn.Linear(2, 1)
    holder = torch.nn.Module()
    holder.model = inner
    family.before_fill(holder, {"model.main_proj.weight"})  # as vLLM's load_weights does
    assert holder.model.confidence_head is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"add": {"mtp.2.attn_norm.weight": (256,)}},
            "the checkpoint holds DSpark stage(s) mtp.[2] but vLLM builds n_mtp_layers=2",
        ),
        (
            {"add": {"mtp.1.confidence_head.proj.bias": (1,)}},
            "the checkpoint's DSpark confidence head has a bias",
        ),
        ({"config": {"draft_vocab_size": 512}}, "draft_vocab_size (512) differs from vocab_size"),
    ],
)
def test_what_vllm_s_loader_would_fail_on_is_refused_in_one_line(
    change: dict[str, Any], message: str
) -> None:
    config = tiny_config(
        V4, num_hidden_layers=2, compress_ratios=[0, 4], **change.get("config", {})
    )
    source = v4_source(config)
    tensors = dict(source.tensors)
    tensors |= {n: ("BF16", s) for n, s in change.get("add", {}).items()}
    with pytest.raises(PlanError) as info:
        model = SourceModel(config, tensors)
        make_plan(model, ConversionRequest(tp=2, pp=1, draft_method="dspark"), model)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_head_in_two_stages_is_refused() -> None:
    config = tiny_config(V4, num_hidden_layers=2, compress_ratios=[0, 4])
    names = ["mtp.0.norm.weight", "mtp.1.norm.weight", "mtp.0.attn.wkv.weight"]
    with pytest.raises(ConfigError, match=r"holds norm.weight in DSpark stages \[0, 1\]"):
        archs.draft_family("dspark", "deepseek_v4").expected_shapes(
            config, PlanContext(draft_names=tuple(names))
        )


def test_no_mtp_leaves_the_draft_out(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", V4, num_hidden_layers=2, compress_ratios=[0, 4])
    manifest = convert(
        str(model), tmp_path / "a", Options(tp=1, pp=1, mtp_draft=False), progress=False
    )
    assert [m.role for m in manifest.models] == ["target"]
    plan = make_plan(
        v4_source(tiny_config(V4, num_hidden_layers=2, compress_ratios=[0, 4])),
        ConversionRequest(tp=1, pp=1),
    )
    assert dict(plan.models[0].skipped)["mtp.0.main_proj.weight"] == (
        "a tensor of the built-in DSpark draft (mtp.*), which vLLM's target does not load; "
        "--no-mtp or config.json without dspark_target_layer_ids leaves it out"
    )
