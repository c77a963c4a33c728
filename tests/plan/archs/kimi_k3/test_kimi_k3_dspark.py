"""Kimi-K3's DSpark draft (`K3DSparkModel`), planned without a vLLM run: the published
draft (tests/data/kimi-k3-dspark, see SOURCE.md there) with the published Kimi-K3 at
tp8 x pp2, the names vLLM's own loading functions give the published tensors, what vLLM
refuses, and the rules on a tiny checkpoint's bytes.

The state itself is compared with vLLM's modules in
`tests/vllm/test_vllm_kimi_k3_dspark.py`; these tests hold the rules read from
`K3DSparkForCausalLM.load_weights` (`models/kimi_k3/nvidia/dspark_mla.py`) at the
published sizes, which no run here can build.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.errors import PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel, TensorPlan

DATA = Path(__file__).resolve().parents[3] / "data"
KIMI = "KimiK3ForConditionalGeneration"
EMBED = "language_model.model.embed_tokens.weight"


def published_draft() -> SourceModel:
    """The published draft: its config.json and its 68 tensors."""
    config = json.loads((DATA / "kimi-k3-dspark" / "config.json").read_text())
    table = json.loads((DATA / "kimi-k3-dspark" / "tensors.json").read_text())
    tensors = {}
    for pattern, (dtype, shape) in table["groups"].items():
        for layer in range(5) if "{L}" in pattern else (None,):
            name = pattern.replace("{L}", str(layer))
            tensors[name] = (dtype, tuple(shape))
    assert len(tensors) == table["count"]
    return SourceModel(config, tensors)


def published_target() -> SourceModel:
    """The published Kimi-K3 config (in bfloat16) and the tensors it implies, its routed
    experts trimmed from 896 to 8 per layer: the draft reads only the target's layers,
    width and vocabulary, and 247,000 expert tensors would make each plan take seconds
    (`tests/plan/archs/kimi_k3/test_kimi_k3.py` plans the whole target)."""
    config = json.loads((DATA / "kimi-k3" / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    config["text_config"]["num_experts"] = 8
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    dtypes = family.source_dtypes(read)
    shapes = family.expected_shapes(read)
    return SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})


def rank(plan: Plan, role: str, pp: int, tp: int) -> dict[str, TensorPlan]:
    return {
        t.name: t for f in plan.files if (f.role, f.pp, f.tp) == (role, pp, tp) for t in f.tensors
    }


@pytest.fixture(scope="module")
def plan() -> Plan:
    """The published pair at tp8 x pp2, the last stage (where the draft lives)."""
    return make_plan(published_target(), ConversionRequest(tp=8, pp=2, stage=1), published_draft())


def vllm_names(names: list[str], layers: int, confidence: bool) -> set[str]:
    """The parameters `K3DSparkForCausalLM.load_weights` fills from these checkpoint
    names: vLLM's own `_duplicate_context_kv_weights` and `hf_to_vllm_mapper` (with the
    confidence head kept when the config enables it, as its `__init__` does)."""
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.models.kimi_k3.nvidia.dspark_mla import (
        K3DSparkForCausalLM,
        _duplicate_context_kv_weights,
    )

    mapper = K3DSparkForCausalLM.hf_to_vllm_mapper
    if confidence:
        mapper = mapper | WeightsMapper(orig_to_new_substr={"confidence_head": "confidence_head"})
    weights = _duplicate_context_kv_weights(((n, torch.empty(0)) for n in names), layers)
    return {mapped for mapped, _ in mapper.apply(weights)}


@pytest.mark.vllm  # imports vLLM's Kimi-K3 DSpark module in this process
def test_the_published_draft_plans_as_vllms_loader_names_it(plan: Plan) -> None:
    pytest.importorskip("vllm")
    names = sorted(published_draft().tensors)
    expected = vllm_names(names, layers=5, confidence=True)
    assert {(f.pp, f.tp) for f in plan.files if f.role == "draft"} == {(1, t) for t in range(8)}
    for t in range(8):
        assert set(rank(plan, "draft", 1, t)) == expected
    assert "model.context_kv_proj.weight" in expected
    assert not any("embed_tokens" in n or "lm_head" in n for n in expected)


def test_the_published_draft_at_tp8_holds_its_share_of_each_layer(plan: Plan) -> None:
    draft = rank(plan, "draft", 1, 3)
    layer = "model.layers.4."
    # q_a (1536) and kv_a (512 + 64) whole; heads 64 / 8 = 8 per rank.
    assert draft[layer + "self_attn.fused_qkv_a_proj.weight"].shape == (1536 + 576, 7168)
    assert draft[layer + "self_attn.q_b_proj.weight"].shape == (8 * 192, 1536)
    assert draft[layer + "self_attn.kv_b_proj.weight"].shape == (8 * 256, 512)
    assert draft[layer + "self_attn.o_proj.weight"].shape == (7168, 8 * 128)
    assert draft[layer + "mlp.gate_up_proj.weight"].shape == (2 * 14336 // 8, 7168)
    assert draft[layer + "mlp.down_proj.weight"].shape == (7168, 14336 // 8)
    assert draft["model.context_kv_proj.weight"].shape == (5 * 576, 7168)
    assert draft["model.context_proj.weight"].shape == (7168, 5 * 7168)
    assert draft["model.markov_head.markov_w2.weight"].shape == (163840, 256)  # 64 | 163840
    confidence = draft["model.confidence_head.proj.weight"]
    assert (confidence.shape, confidence.dtype) == ((1, 7168 + 256), "F32")
    # Each rank: the published parameters but the embedding, the split ones an eighth,
    # and the kv_a projections a second time (context_kv_proj).
    published = {n: math.prod(s) for n, (_, s) in published_draft().tensors.items()}
    split = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    share = sum(v // 8 if any(x in n for x in split) else v for n, v in published.items())
    share += -published["embed_tokens.weight"] + 5 * 576 * 7168
    assert sum(math.prod(t.shape) for t in draft.values()) == share
    # The target: its embedding on the last stage too, which only a DSpark run builds.
    target = rank(plan, "target", 1, 3)
    assert target[EMBED].shape == (163840 // 8, 7168)
    (entry,) = [m for m in plan.models if m.role == "target"]
    assert entry.spec_decode_only == ((EMBED, 1),)
    (draft_entry,) = [m for m in plan.models if m.role == "draft"]
    assert (draft_entry.family, draft_entry.method) == ("kimi_k3_dspark", "dspark")
    assert dict(draft_entry.skipped)["embed_tokens.weight"].startswith("vLLM's Kimi-K3 DSpark")


def test_the_draft_is_recognized_without_draft_method() -> None:
    draft = published_draft()
    names = sorted(draft.tensors)
    assert archs.detect_draft_method(draft.config, names, "kimi_k3") == "dspark"
    assert archs.draft_family("dspark", "kimi_k3").name == "kimi_k3_dspark"


@pytest.mark.vllm  # vLLM's own config class
@pytest.mark.parametrize(
    "change",
    [
        {"mla_use_output_gate": True},
        {"mla_use_nope": True},
        {"dspark_bonus_anchor": True},
        {"draft_vocab_size": 1000},
        {"num_target_layers": 4},
    ],
)
def test_what_vllms_config_class_refuses_is_refused_in_one_line(change: dict) -> None:
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    draft = published_draft()
    K3DSparkConfig(**draft.config)  # the published config is accepted as it is
    config = {**draft.config, **change}
    with pytest.raises(ValueError, match="MLA DSpark"):
        K3DSparkConfig(**config)
    with pytest.raises(PlanError) as caught:
        make_plan(
            published_target(),
            ConversionRequest(tp=8, pp=2, stage=1),
            SourceModel(config, draft.tensors),
        )
    lines = [line for line in str(caught.value).splitlines() if "draft:" in line]
    assert len(lines) == 1, str(caught.value)


def test_a_draft_for_another_target_or_tp_is_refused_in_one_line() -> None:
    draft = published_draft()
    moved = {**draft.config, "target_layer_ids": [2, 23, 47, 71, 93]}
    with pytest.raises(PlanError, match=r"target_layer_ids \[93\] name layers the target"):
        make_plan(
            published_target(),
            ConversionRequest(tp=8, pp=2, stage=1),
            SourceModel(moved, draft.tensors),
        )
    with pytest.raises(PlanError, match="num_attention_heads \\(64\\) is not divisible by tp=128"):
        make_plan(published_target(), ConversionRequest(tp=128, pp=1), draft)


def test_another_draft_kind_for_kimi_k3_is_refused_in_one_line(tmp_path: Path) -> None:
    target = make_tiny_model(tmp_path / "t", KIMI)
    draft = make_tiny_draft(tmp_path / "d", target, "dspark")
    with pytest.raises(PlanError, match="a draft of method 'eagle3' for Kimi-K3 is not supported"):
        convert(str(target), tmp_path / "a", Options(tp=1, pp=1, draft=str(draft),
                draft_method="eagle3"), progress=False)  # fmt: skip
    qwen3 = make_tiny_draft(tmp_path / "q", make_tiny_model(tmp_path / "l"), "dspark")
    with pytest.raises(PlanError, match=r"\['Qwen3DSparkModel'\] .* not K3DSparkModel"):
        convert(str(target), tmp_path / "b", Options(tp=1, pp=1, draft=str(qwen3),
                draft_method="dspark"), progress=False)  # fmt: skip


def test_the_rules_on_the_bytes_of_a_tiny_draft(tmp_path: Path) -> None:
    """What vLLM's weight loaders make of each source tensor, at tp2 x pp2: the fused
    `q_a`/`kv_a`, every layer's `kv_a` stacked into `context_kv_proj` (shard i = layer i),
    rows and columns of rank t, `markov_w2` padded to 64 rows, the confidence head cast
    to float32; the draft on the last stage only, the embedding dropped."""
    target = make_tiny_model(tmp_path / "t", KIMI, torch_dtype="bfloat16", vocab_size=250)
    draft = make_tiny_draft(tmp_path / "d", target, "dspark")  # the target's vocabulary
    src = load_file(draft / "model.safetensors")
    convert(str(target), tmp_path / "a", Options(tp=2, pp=2, draft=str(draft)), progress=False)
    manifest = read_manifest(tmp_path / "a")
    assert {(f.pp, f.tp) for f in manifest.files if f.role == "draft"} == {(1, 0), (1, 1)}
    for t in (0, 1):
        (entry,) = manifest.rank_files("draft", 1, t)
        got = load_file(tmp_path / "a" / entry.path)
        for i in (0, 1):
            s, p = f"layers.{i}.self_attn.", f"model.layers.{i}.self_attn."
            fused = torch.cat([src[s + "q_a_proj.weight"], src[s + "kv_a_proj_with_mqa.weight"]])
            assert torch.equal(got[p + "fused_qkv_a_proj.weight"], fused)
            assert torch.equal(got[p + "q_b_proj.weight"], src[s + "q_b_proj.weight"].chunk(2)[t])
            assert torch.equal(got[p + "o_proj.weight"], src[s + "o_proj.weight"].chunk(2, 1)[t])
            m, q = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
            gate_up = [src[m + x].chunk(2)[t] for x in ("gate_proj.weight", "up_proj.weight")]
            assert torch.equal(got[q + "gate_up_proj.weight"], torch.cat(gate_up))
        kv = [src[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for i in (0, 1)]
        assert torch.equal(got["model.context_kv_proj.weight"], torch.cat(kv))
        w2 = got["model.markov_head.markov_w2.weight"]
        assert w2.shape == (256, 16) and not w2[250:].any()
        assert torch.equal(w2[:250], src["markov_head.markov_w2.weight"])
        bias = got["model.confidence_head.proj.bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias, src["confidence_head.proj.bias"].float())
        assert not any("embed_tokens" in n for n in got)
