"""Drafts given with `--draft` (EAGLE, EAGLE3, DFlash, DSpark) derived from vLLM's own
model definition (plan/derived/standalone.py): for each draft family shardprep writes
by hand, on the tiny drafts its tests use, the derived draft plan equals the
hand-written one piece for piece at tp2 x pp2 (no weights: headers only), the parameters
vLLM's proposers may replace with the target's included; a derived target plans an
EAGLE3 draft as the hand-written plan does, the embedding vLLM then also builds on the
last stage included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from plans import assert_derived_like_written, assert_same_layout

from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.errors import PlanError
from shardprep.format.headers import read_header
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import Layout, PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.derived import DerivedFamily, available
from shardprep.plan.derived.drafts import Speculative, built_beside
from shardprep.plan.derived.standalone import DerivedDraft
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
from shardprep.plan.topology import make_topology

needs_vllm = pytest.mark.skipif(not available(), reason="deriving needs vLLM installed")
K3 = "KimiK3ForConditionalGeneration"
CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
SHARED = ("embed_tokens.weight", "lm_head.weight")
L4, L5, L6 = ({"num_hidden_layers": n} for n in (4, 5, 6))

CASES = {
    # name: (method, target architecture, target config overrides, tp, pp, tensors the
    # draft leaves out, draft config overrides), as tests/vllm makes these drafts
    "eagle-tp2-pp2": ("eagle", "LlamaForCausalLM", L5, 2, 2, (), {}),
    # a draft vocabulary of its own (d2t), the auxiliary layers on the last stage
    "eagle3-tp2-pp2": (
        "eagle3", "LlamaForCausalLM", L6, 2, 2, (), {"eagle_aux_hidden_state_layer_ids": [4, 5, 6]}
    ),
    # no embedding of its own: vLLM shares the target's
    "eagle3-no-embedding-tp2": ("eagle3", "Qwen3ForCausalLM", L6, 2, 1, SHARED[:1], {}),
    "dflash-tp2-pp2": ("dflash", "LlamaForCausalLM", L6, 2, 2, (), {}),
    "dflash-shared-heads-tp2": ("dflash", "Qwen3ForCausalLM", L4, 2, 1, SHARED, {}),
    # the Markov head padded and not split, the confidence head in float32
    "dspark-tp2-pp2": ("dspark", "Qwen3ForCausalLM", L6, 2, 2, (), {}),
    "dspark-shared-heads-no-confidence-tp2-pp2": (
        "dspark", "Qwen3ForCausalLM", L6, 2, 2, (*SHARED, *CONFIDENCE), {}
    ),
    "dspark-sink-bias-tp2-pp2": (
        "dspark", "Qwen3ForCausalLM", L6, 2, 2, (), {"dflash_config": {"attention_sink_bias": True}}
    ),
    # a vocabulary not of 64s, so that the Markov head's padding shows
    "kimi-k3-dspark-tp2-pp2": ("dspark", K3, {"vocab_size": 300}, 2, 2, (), {}),
}  # fmt: skip
NOT_YET: dict[str, str] = {}  # name: why it is not derived yet (a strict expected failure)


def _case(name: str) -> Any:
    if name not in NOT_YET:
        return name
    not_yet = pytest.mark.xfail(strict=True, raises=PlanError, reason=NOT_YET[name])
    return pytest.param(name, marks=not_yet)


def _pair(root: Path, case: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple]]:
    """The target's config.json, the draft's, and the draft's tensors."""
    method, arch, sizes, _, _, omit, overrides = CASES[case]
    model = make_tiny_model(root / "model", arch, **sizes)
    draft = make_tiny_draft(root / "draft", model, method, omit=omit, **overrides)
    target = json.loads((model / "config.json").read_text())
    header = read_header(draft / "model.safetensors")
    tensors = {name: (info.dtype, tuple(info.shape)) for name, info in header.tensors.items()}
    return target, json.loads((draft / "config.json").read_text()), tensors


def _hand_written(case: str, target: dict, config: dict, tensors: dict) -> Layout:
    method, _, _, tp, pp, _, _ = CASES[case]
    target = archs.read_config(target)  # as the target's family reads it
    family = archs.draft_family(method, archs.target_family(target)[1].name)
    shapes = {name: shape for name, (_, shape) in tensors.items()}
    topology = make_topology(target["num_hidden_layers"], tp, pp, None, "")
    ctx = PlanContext(pp=pp, target_config=target, draft_names=tuple(sorted(shapes)))
    return quantized.layout(family, config, shapes, topology, ctx)


@pytest.mark.parametrize("case", [_case(name) for name in sorted(CASES)])
@pytest.mark.vllm
@needs_vllm
def test_derived_draft_plan_equals_the_hand_written_one(case: str, tmp_path: Path) -> None:
    method, _, _, tp, pp, _, _ = CASES[case]
    target, config, tensors = _pair(tmp_path, case)
    written = _hand_written(case, target, config, tensors)
    family = archs.draft_family(method, "derived")
    assert isinstance(family, DerivedDraft) and family.method == method
    shapes = {name: shape for name, (_, shape) in tensors.items()}
    layers = archs.read_config(target)["num_hidden_layers"]
    topology = make_topology(layers, tp, pp, None, "")
    dtypes = {name: dtype for name, (dtype, _) in tensors.items()}
    ctx = PlanContext(pp=pp, target_config=target, dtypes=dtypes)
    derived = family.layout(config, shapes, topology, ctx)
    assert_same_layout(derived, written)
    assert {stage for p in derived.params for stage in p.stages} == {pp - 1}


@pytest.mark.vllm
@needs_vllm
def test_a_target_no_family_names_plans_its_eagle3_draft_as_the_hand_written_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama planned as if no family named it, with an EAGLE3 draft at tp2 x pp2: target
    and draft derived, the same pieces as the hand-written plan, the target's embedding
    also on the last stage (spec-decode only), the draft's files on the last stage."""
    case = "eagle3-tp2-pp2"
    _, arch, _, tp, pp, _, _ = CASES[case]
    target, config, tensors = _pair(tmp_path, case)
    header = read_header(tmp_path / "model" / "model.safetensors")
    source = SourceModel(target, {n: (i.dtype, tuple(i.shape)) for n, i in header.tensors.items()})
    draft = SourceModel(config, tensors)
    request = ConversionRequest(tp=tp, pp=pp, draft_method="eagle3")
    written = make_plan(source, request, draft)
    monkeypatch.delitem(archs._TARGETS, arch)
    derived = make_plan(source, request, draft)
    assert_derived_like_written(derived, written)
    assert derived.models[0].spec_decode_only == (("model.embed_tokens.weight", pp - 1),)
    assert {f.pp for f in derived.files if f.role == "draft"} == {pp - 1}


def test_a_derived_target_takes_the_drafts_it_derives_and_refuses_another_in_one_line() -> None:
    family = DerivedFamily()
    for method in ("mtp", "eagle", "eagle3", "dflash", "dspark"):
        assert family.check({}, 2, PlanContext(draft_method=method)) == []
    assert family.check({}, 2, PlanContext(draft_method="medusa")) == [
        "a medusa draft beside a derived layout is not supported yet (those of dflash, "
        "dspark, eagle, eagle3, mtp are); convert without --draft"
    ]


def test_a_derived_draft_answers_as_its_method_where_the_layout_cannot() -> None:
    """How a checkpoint of the method is told, what vLLM may leave unloaded, which side
    file it reads: the method's own draft family's answers."""
    for method in ("eagle", "eagle3", "dflash", "dspark"):
        mine, theirs = archs.draft_family(method, "derived"), archs.draft_family(method, "*")
        assert mine.standalone and mine.may_stay_unloaded == theirs.may_stay_unloaded
    assert archs.detect_draft_method({}, ["midlayer.mlp.up_proj.weight"], "derived") == "eagle3"
    dflash = archs.draft_family("dflash", "derived")
    config = {"dflash_config": {"mask_token_id": 3}}
    assert dflash.side_tensor_files(config) == {"mask_embedding": "mask_embedding.pt"}


def test_a_side_file_tensor_of_a_derived_draft_is_refused_in_one_line() -> None:
    dflash = archs.draft_family("dflash", "derived")
    config = {"dflash_config": {"mask_token_id": 3}}
    ctx = PlanContext(draft_names=("fc.weight", "mask_embedding"))
    assert dflash.check(config, 2, ctx) == [
        "its mask_embedding comes from a side file that vLLM reads beside the checkpoint, "
        "which a derived draft layout does not follow yet; convert the draft without that file "
        "(vLLM then embeds the mask token as any other)"
    ]
    assert dflash.check(config, 2, PlanContext(draft_names=("fc.weight",))) == []


def test_what_vllm_adds_to_a_target_beside_a_draft_is_spec_decode_only() -> None:
    from shardprep.plan.archs.base import Param
    from shardprep.plan.cuts import Cut, Piece

    embed = (Piece("embed", Cut.VOCAB),)
    norm = Param("norm", (Piece("norm", Cut.REPLICATE),), (1,))
    alone = Layout((Param("embed", embed, (0,)), norm))
    beside = Layout((Param("embed", embed, (0, 1)), norm))
    assert built_beside(alone, beside).spec_decode_only == {("embed", 1)}
    assert built_beside(alone, beside).params == beside.params
    assert built_beside(alone, alone).spec_decode_only == frozenset()


def test_a_speculative_draft_is_its_method_and_sorted_config() -> None:
    first = Speculative.of("eagle3", {"b": 1, "a": [2]})
    assert first == Speculative.of("eagle3", {"a": [2], "b": 1})
    assert first.config == {"a": [2], "b": 1} and hash(first) == hash(
        Speculative.of("eagle3", first.config)
    )
