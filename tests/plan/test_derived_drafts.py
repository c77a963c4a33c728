"""The MTP draft derived from vLLM's own model definition (plan/derived/drafts.py): for
the MTP drafts shardprep writes by hand, the derived draft plan equals the hand-written
one piece for piece at tp2 x pp2 (no weights: headers only), the parameters vLLM's
proposer replaces with the target's included; a derived target plans its MTP draft on the
last stage. The record's rules (a later write over a region, the shared parameters) are
tested on records made by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import vllm_env
from derived_mtp import GLM, QWEN35, make_mtp_model
from plans import assert_derived_like_written, assert_same_layout

from shardprep.demo.tiny import (
    TINY_FP8,
    TINY_FP8_CT,
    TINY_INT4,
    TINY_MXFP4_PACK,
    TINY_NVFP4_PACK,
    tiny_config,
)
from shardprep.errors import PlanError
from shardprep.format.headers import read_header
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.derived import DERIVED, DerivedFamily, DerivedMtpDraft, available
from shardprep.plan.derived.drafts import MTP_HELD, mtp_layers, split_shared
from shardprep.plan.derived.infer import Inference
from shardprep.plan.derived.overwrites import last_writes
from shardprep.plan.derived.quant import model_scheme
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
from shardprep.plan.topology import make_topology

needs_vllm = pytest.mark.skipif(not available(), reason="deriving needs vLLM installed")

# Sizes of whole 128-blocks a rank at tp2 for fp8 (a refined block grid is refused), of
# whole 32-blocks for MXFP4 experts
MLA_BLOCKS = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256}
MLA_BLOCKS |= {"n_shared_experts": 2}
MXFP4_SIZES = {"moe_intermediate_size": 128, "hidden_size": 256}
GLM_BLOCKS = {"hidden_size": 256, "head_dim": 128, "intermediate_size": 512}
GLM_BLOCKS |= {"moe_intermediate_size": 256, "num_hidden_layers": 3}
NEXT_BLOCKS = {"hidden_size": 256, "head_dim": 128, "moe_intermediate_size": 256}
NEXT_BLOCKS |= {"shared_expert_intermediate_size": 256}
# Qwen3-Next's in_proj_ba (8 rows) is left in the model dtype, as published.
NEXT_KEPT = ["lm_head", *(f"model.layers.{i}.linear_attn.in_proj_ba" for i in (0, 2))]
NEXT_FP8 = TINY_FP8 | {"modules_to_not_convert": NEXT_KEPT}

CASES = {
    # name: (architecture, tp, pp, config overrides)
    # MLA and experts in the MTP layer, its own embedding copy loaded over the target's
    "deepseek-v3-tp2-pp2": (
        "DeepseekV3ForCausalLM", 2, 2, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    ),
    # at pp=1 vLLM shares the target's embedding with the draft too
    "deepseek-v3-tp2": (
        "DeepseekV3ForCausalLM", 2, 1, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    ),
    # mtp.* renamed to model.*, fc split by rows, gated attention, a gated shared expert
    "qwen3-next-tp2-pp2": ("Qwen3NextForCausalLM", 2, 2, {}),
    # fp8 blocks, the MTP layer's too: each scale cut with its weight
    "deepseek-v3-fp8-tp2-pp2": (
        "DeepseekV3ForCausalLM", 2, 2,
        {"num_hidden_layers": 3, "num_nextn_predict_layers": 1, "quantization_config": TINY_FP8},
    ),
    # Each scheme on every MTP draft that converts it, and each MTP draft family
    **{
        f"{prefix}-{name}-tp2": (
            arch, 2, 1,
            {"num_hidden_layers": 2, "num_nextn_predict_layers": 1, **sizes,
             "quantization_config": quant},
        )
        for prefix, arch in (
            ("deepseek-v3", "DeepseekV3ForCausalLM"), ("deepseek-v3.2", "DeepseekV32ForCausalLM")
        )
        for name, quant, sizes in (
            ("fp8-ct", TINY_FP8_CT, {}),
            ("int4", TINY_INT4, {}),
            ("mxfp4-pack", TINY_MXFP4_PACK, MXFP4_SIZES),
            ("nvfp4", TINY_NVFP4_PACK, {}),
        )
        if (arch, name) != ("DeepseekV32ForCausalLM", "fp8-ct")  # not a V3.2 scheme
    },
    # the indexer's wk, which vLLM dequantizes, in the MTP layer too
    "deepseek-v3.2-fp8-tp2-pp2": (
        "DeepseekV32ForCausalLM", 2, 2,
        {"num_hidden_layers": 3, "num_nextn_predict_layers": 1, **MLA_BLOCKS,
         "quantization_config": TINY_FP8},
    ),
    "deepseek-v3.2-tp2-pp2": (
        "DeepseekV32ForCausalLM", 2, 2, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    ),
    "glm-4.5-tp2-pp2": ("Glm4MoeForCausalLM", 2, 2, {"num_nextn_predict_layers": 1}),
    "glm-4.5-fp8-tp2": (
        "Glm4MoeForCausalLM", 2, 1,
        {"num_nextn_predict_layers": 1, **GLM_BLOCKS, "quantization_config": TINY_FP8},
    ),
    "qwen3-next-fp8-tp2": (
        "Qwen3NextForCausalLM", 2, 1, {**NEXT_BLOCKS, "quantization_config": NEXT_FP8}
    ),
    "kimi-k3-tp2": ("KimiK3ForConditionalGeneration", 2, 1, {"num_nextn_predict_layers": 1}),
    "qwen3.5-moe-tp2": ("Qwen3_5MoeForConditionalGeneration", 2, 1, {}),
}  # fmt: skip


def _hand_written(arch: str, tp: int, pp: int, overrides: dict[str, Any]) -> tuple:
    config = archs.read_config(tiny_config(arch, **overrides))
    _, family = archs.target_family(config)
    draft = archs.draft_family("mtp", family.name)
    shapes = quantized.expected_shapes(family, config) | quantized.expected_shapes(draft, config)
    # what convert adds: the weights vLLM dequantizes while loading (DeepSeek-V3.2's wk)
    dtypes = quantized.source_dtypes(family, config) | quantized.source_dtypes(draft, config)
    computed = family.dequantized_sources(config, dtypes, shapes)
    shapes |= {name: shapes[weight] for name, (weight, _) in computed.items()}
    topology = make_topology(config["num_hidden_layers"], tp, pp, None, "")
    ctx = PlanContext(pp=pp, target_config=config, draft_names=tuple(sorted(shapes)))
    return config, shapes, topology, quantized.layout(draft, config, shapes, topology, ctx)


def test_every_scheme_of_every_mtp_draft_has_a_case() -> None:
    drafts = {archs.draft_family(m, t) for m, t in archs._DRAFTS if m == "mtp" and t != DERIVED}
    wanted = {(d.name, s) for d in drafts for s in {"", *d.quant_schemes}}
    covered = set()
    for arch, _, _, overrides in CASES.values():
        scheme = model_scheme(tiny_config(arch, **overrides))  # or its text_config's
        family = archs.target_family_of(arch)
        draft = archs.draft_family("mtp", family.name)
        covered.add((draft.name, scheme.name if scheme else ""))
    assert wanted <= covered


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.vllm
@needs_vllm
def test_derived_mtp_draft_plan_equals_the_hand_written_one(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arch, tp, pp, overrides = CASES[case]
    if arch == "KimiK3ForConditionalGeneration":  # the GEMM not fused with an all-reduce
        monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    if arch.startswith("Qwen3_5") and vllm_env.torchvision_path() is not None:
        monkeypatch.setenv("PYTHONPATH", vllm_env.with_torchvision()["PYTHONPATH"])
    config, shapes, topology, written = _hand_written(arch, tp, pp, overrides)
    family = archs.target_family(config)[1]
    draft = archs.draft_family("mtp", family.name)
    dtypes = quantized.source_dtypes(family, config) | quantized.source_dtypes(draft, config)
    published = tiny_config(arch, **overrides)  # vLLM reads config.json as published
    context = PlanContext(pp=pp, dtypes=dtypes)
    derived = DerivedMtpDraft().layout(published, shapes, topology, context)
    assert_same_layout(derived, written)
    assert {stage for p in derived.params for stage in p.stages} == {pp - 1}


@pytest.mark.parametrize("case", ["deepseek-v3-tp2-pp2", "deepseek-v3-fp8-tp2-pp2"])
@pytest.mark.vllm
@needs_vllm
def test_a_target_no_family_names_plans_its_mtp_draft_as_the_hand_written_plan(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3 planned as if no family named it: target and MTP draft derived, the
    same pieces as the hand-written plan, the draft's files on the last stage only."""
    arch, tp, pp, overrides = CASES[case]
    config, shapes, _, _ = _hand_written(arch, tp, pp, overrides)
    family = archs.target_family(config)[1]
    draft = archs.draft_family("mtp", family.name)
    dtypes = quantized.source_dtypes(family, config) | quantized.source_dtypes(draft, config)
    tensors = {name: (dtypes.get(name, "BF16"), shape) for name, shape in shapes.items()}
    source = SourceModel(config, tensors)
    request = ConversionRequest(tp=tp, pp=pp, draft_method="mtp")
    written = make_plan(source, request, source)
    monkeypatch.delitem(archs._TARGETS, arch)
    assert archs.internal_draft_method(config) == "mtp"
    derived = make_plan(source, request, source)
    assert_derived_like_written(derived, written)
    assert dict(derived.models[0].skipped)["model.layers.3.eh_proj.weight"] == MTP_HELD
    assert {f.pp for f in derived.files if f.role == "draft"} == {pp - 1}


@pytest.mark.vllm
@needs_vllm
def test_qwen3_5_moe_text_mtp_draft_no_family_names_follows_the_qwen3_next_mtp_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's `Qwen3_5MoeMTP` (of `Qwen3_5MoeForCausalLM`, which no family names) loads
    the `mtp.*` tensors as `Qwen3NextMTP` does: the hand-written Qwen3-Next MTP rules,
    given the MTP layer count under their own key, place them piece for piece alike."""
    model = make_mtp_model(tmp_path / "model", QWEN35)
    monkeypatch.setenv("PYTHONPATH", vllm_env.with_torchvision()["PYTHONPATH"])
    config = json.loads((model / "config.json").read_text())
    header = read_header(model / "model.safetensors")
    shapes = {name: tuple(info.shape) for name, info in header.tensors.items()}
    topology = make_topology(config["num_hidden_layers"], 2, 2, None, "")
    derived = DerivedMtpDraft().layout(config, shapes, topology, PlanContext(pp=2))
    qwen3_next = archs.draft_family("mtp", "qwen3_next")
    rules = qwen3_next.read_config({**config, "num_nextn_predict_layers": 1})
    ctx = PlanContext(pp=2, target_config=rules, draft_names=tuple(sorted(shapes)))
    assert_same_layout(derived, quantized.layout(qwen3_next, rules, shapes, topology, ctx))
    assert derived.shared_with_target == {"lm_head.weight"}


@pytest.mark.vllm
@needs_vllm
def test_an_mtp_draft_vllm_does_not_build_is_one_line() -> None:
    """Llama has no MTP layers: vLLM's speculative config refuses the method."""
    config = tiny_config("LlamaForCausalLM")
    shapes = archs.target_family(config)[1].expected_shapes(config)
    topology = make_topology(config["num_hidden_layers"], 2, 1, None, "")
    with pytest.raises(PlanError) as info:
        DerivedMtpDraft().layout(config, shapes, topology, PlanContext())
    assert str(info.value) == (
        "MTP draft: cannot derive the layout from vLLM: vLLM raised NotImplementedError: "
        "Unsupported speculative method: 'mtp'; --no-mtp converts the target alone"
    )


@pytest.mark.vllm
@needs_vllm
def test_mtp_layers_config_json_promises_and_the_checkpoint_lacks_are_one_line(
    tmp_path: Path,
) -> None:
    """As transformers saves GLM-4.7-Flash: no MTP layer. vLLM's loader names what its
    draft lacks; the target alone plans."""
    model = make_mtp_model(tmp_path / "model", GLM, with_mtp=False)
    config = json.loads((model / "config.json").read_text())
    header = read_header(model / "model.safetensors")
    source = SourceModel(config, {n: (i.dtype, i.shape) for n, i in header.tensors.items()})
    with pytest.raises(PlanError) as info:
        make_plan(source, ConversionRequest(tp=2, pp=1, draft_method="mtp"), source)
    message = str(info.value)
    assert message.startswith(
        "MTP draft: cannot derive the layout from vLLM: vLLM raised ValueError: Following "
        "weights were not initialized from checkpoint: {"
    )
    assert "'model.layers.3.eh_proj.weight'" in message
    assert message.endswith("}; --no-mtp converts the target alone")
    alone = make_plan(source, ConversionRequest(tp=2, pp=1))
    assert [m.role for m in alone.models] == ["target"]


@pytest.mark.parametrize(
    ("config", "layers"),
    [
        ({"num_nextn_predict_layers": 1}, 1),
        ({"text_config": {"mtp_num_hidden_layers": 2}}, 2),
        ({"num_nextn_predict_layers": 0}, 0),
        ({"mtp_num_hidden_layers": True}, 0),
        ({}, 0),
    ],
)
def test_the_mtp_layers_config_json_promises(config: dict[str, Any], layers: int) -> None:
    assert mtp_layers(config) == layers
    assert DerivedFamily().internal_draft(config) == ("mtp" if layers else None)


def _copy(param: str, start: int, source: str) -> list[Any]:
    return ["copy", param, [start, [2, 4], [4, 1]], source, [0, [2, 4], [4, 1]], "F32"]


def test_a_write_a_later_one_covers_whole_is_dropped_a_partial_one_is_kept() -> None:
    """DeepSeek's MTP loads the embedding from the target's tensor, then from the first
    MTP layer's copy: what vLLM leaves is the copy."""
    first, second = _copy("embed", 0, "model.embed"), _copy("embed", 0, "layer.embed")
    assert last_writes([first, _copy("other", 0, "x"), second]) == [_copy("other", 0, "x"), second]
    partial = ["copy", "embed", [4, [2, 4], [4, 1]], "layer.embed", [0, [2, 4], [4, 1]], "F32"]
    assert last_writes([first, partial]) == [first, partial]
    sources = {"model.embed": ("F32", (2, 4)), "layer.embed": ("F32", (2, 4))}
    record = {"rank": [0, 0], "model_dtype": "F32", "params": {"embed": ["F32", [2, 4]]}}
    with pytest.raises(PlanError, match="writes twice into embed"):
        Inference({}, sources, 1).add({**record, "ops": last_writes([first, partial])})


def test_shared_parameters_leave_the_record_and_their_only_sources_say_why() -> None:
    record = {
        "rank": [1, 0],
        "params": {"head": ["F32", [2, 4]], "norm": ["F32", [2, 4]]},
        "ops": [_copy("head", 0, "lm_head.weight"), _copy("norm", 0, "norm.weight")],
        "shared": ["head"],
    }
    kept, sources = split_shared(record)
    assert kept["params"] == {"norm": ["F32", [2, 4]]}
    assert kept["ops"] == [_copy("norm", 0, "norm.weight")]
    assert sources == {"lm_head.weight": "head"}
