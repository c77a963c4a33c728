"""The layout derived from vLLM's own model definition (plan/derived): for families that
shardprep writes by hand, the derived plan equals the hand-written one piece for piece
(no weights: headers only); what vLLM's load_weights does that no plan expresses is
refused in one line naming the parameter. Without vLLM, the one line that says what to
install is tested in test_plan.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from derived_models import make_transformers_model

from shardprep.demo.tiny import tiny_config
from shardprep.errors import PlanError
from shardprep.format.headers import read_header
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.derived import DerivedFamily, available
from shardprep.plan.derived.infer import Inference
from shardprep.plan.drafts import with_target_rules
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
from shardprep.plan.topology import make_topology

# Deriving runs vLLM in a child of this Python, so vLLM must be installed here.
needs_vllm = pytest.mark.skipif(not available(), reason="deriving needs vLLM installed")

CASES = {
    # name: (architecture, tp, pp, config overrides)
    "llama-tp2-pp2": ("LlamaForCausalLM", 2, 2, {}),
    "llama-tp4-kv-replicated": ("LlamaForCausalLM", 4, 1, {}),
    "qwen2-tied-bias-tp2-pp2": ("Qwen2ForCausalLM", 2, 2, {"tie_word_embeddings": True}),
    "qwen3-tp2": ("Qwen3ForCausalLM", 2, 1, {}),
    "qwen3-moe-tp2": ("Qwen3MoeForCausalLM", 2, 1, {}),
    "mixtral-tp2-pp2": ("MixtralForCausalLM", 2, 2, {}),
    # MLA, a fused q_a/kv_a projection, shared and routed experts, dense first layer
    "deepseek-v3-tp2-pp2": ("DeepseekV3ForCausalLM", 2, 2, {"num_hidden_layers": 5}),
}


def _context(pp: int) -> PlanContext:
    return PlanContext(pp=pp)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.vllm
@needs_vllm
def test_derived_plan_equals_the_hand_written_plan(case: str) -> None:
    arch, tp, pp, overrides = CASES[case]
    config = archs.read_config(tiny_config(arch, **overrides))
    _, family = archs.target_family(config)
    shapes = quantized.expected_shapes(family, config)
    topology = make_topology(config["num_hidden_layers"], tp, pp, None, "")
    written = quantized.layout(family, config, shapes, topology, _context(pp))
    written = with_target_rules(family, config, shapes, topology, written, _context(pp))
    derived = DerivedFamily().layout(config, shapes, topology, _context(pp))
    assert {p.name: p for p in derived.params} == {p.name: p for p in written.params}
    assert set(derived.skipped) == set(written.skipped)
    assert derived.num_experts == written.num_experts


@pytest.mark.vllm
@needs_vllm
def test_value_arithmetic_in_load_weights_is_refused_naming_the_parameter(
    tmp_path: Path,
) -> None:
    """vLLM's Mamba loader stores A = -exp(A_log): no copy of checkpoint bytes makes it."""
    model = make_transformers_model(tmp_path / "mamba", "MambaForCausalLM")
    header = read_header(model / "model.safetensors")
    tensors = {name: (info.dtype, info.shape) for name, info in header.tensors.items()}
    config = json.loads((model / "config.json").read_text())
    with pytest.raises(PlanError) as info:
        make_plan(SourceModel(config, tensors), ConversionRequest(tp=2, pp=1))
    assert str(info.value) == (
        "cannot derive the layout from vLLM: backbone.layers.0.mixer.A: vLLM's load_weights "
        "computes it from backbone.layers.0.mixer.A_log (cast, exp, neg), value arithmetic a "
        "plan of copies cannot express"
    )


@pytest.mark.vllm
@needs_vllm
def test_an_architecture_vllm_does_not_register_either_is_one_line() -> None:
    config = tiny_config()
    shapes = archs.target_family(config)[1].expected_shapes(config)
    config["architectures"] = ["NoSuchForCausalLM"]
    with pytest.raises(PlanError) as info:
        make_plan(
            SourceModel(config, {n: ("F32", s) for n, s in shapes.items()}),
            ConversionRequest(tp=2, pp=1),
        )
    assert str(info.value) == (
        "cannot derive the layout from vLLM: architecture NoSuchForCausalLM is not registered "
        "in vLLM 0.32.0 either, so there is no model definition to derive its layout from; "
        "use a vLLM that serves it"
    )


def _record(ops: list[list[Any]], params: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return {"rank": [0, rank], "model_dtype": "F32", "params": params, "ops": ops}


def test_a_strided_write_a_gap_and_a_fill_of_a_value_are_refused_naming_the_parameter() -> None:
    sources = {"w": ("F32", (4, 4))}
    params = {"p": ["F32", [4, 4]]}
    strided = ["copy", "p", [0, [4, 2], [4, 1]], "w", [0, [4, 2], [4, 1]], "F32"]
    with pytest.raises(PlanError, match="writes p in a strided region"):
        Inference({}, sources, 1).add(_record([strided], params))
    gap = ["copy", "p", [0, [2, 4], [4, 1]], "w", [0, [2, 4], [4, 1]], "F32"]
    with pytest.raises(PlanError, match="leaves 8 of the 16 values of p unwritten"):
        Inference({}, sources, 1).add(_record([gap], params))
    ones = ["fill", "p", [8, [2, 4], [4, 1]], 1.0]
    with pytest.raises(PlanError, match="fills p with 1.0"):
        Inference({}, sources, 1).add(_record([gap, ones], params))


def test_rows_that_follow_no_cut_are_refused_naming_the_parameter() -> None:
    """Rank 1 reads the same rows as rank 0: not a split, not a copy of the whole."""
    sources = {"w": ("F32", (4, 4))}
    params = {"p": ["F32", [2, 4]]}
    inference = Inference({}, sources, 2)
    for rank in (0, 1):
        ops = [["copy", "p", [0, [2, 4], [4, 1]], "w", [0, [2, 4], [4, 1]], "F32"]]
        inference.add(_record(ops, params, rank))
    with pytest.raises(PlanError, match=r"1 parameter\(s\): p <- w: vLLM's load_weights copies"):
        inference.layout()


def test_a_parameter_reshaped_from_its_source_is_refused_naming_it() -> None:
    """vLLM squeezes a [1, 4] routing bias to [4]: the same values, a shape no cut gives."""
    sources = {"bias": ("F32", (1, 4))}
    inference = Inference({}, sources, 1)
    ops = [["copy", "p", [0, [4], [1]], "bias", [0, [4], [1]], "F32"]]
    inference.add(_record(ops, {"p": ["F32", [4]]}))
    with pytest.raises(PlanError, match=r"p <- bias: vLLM holds \[4\] where the checkpoint's re"):
        inference.layout()


def _row(offset: int) -> list[Any]:
    """One row of 3 values, as a region (offset, sizes, strides)."""
    return [offset, [1, 3], [3, 1]]


def test_experts_stacked_in_one_source_are_read_each_from_its_own_matrix() -> None:
    """A [2 experts, 2 x 2 rows, 3] gate-up stack into vLLM's [2, 2, 3] w13 at tp 2: each
    rank copies its row of each half of each expert; each expert is a piece of its own."""
    inference = Inference({}, {"gu": ("F32", (2, 4, 3))}, 2)
    for rank in (0, 1):
        ops = [
            ["copy", "w13", _row((2 * e + h) * 3), "gu", _row((4 * e + 2 * h + rank) * 3), "F32"]
            for e in (0, 1)
            for h in (0, 1)
        ]
        inference.add(_record(ops, {"w13": ["F32", [2, 2, 3]]}, rank))
    layout = inference.layout()
    (param,) = layout.params
    assert param.pieces == tuple(Piece("gu", Cut.EXPERT_HALVES_ROWS, expert=e) for e in (0, 1))
    assert layout.num_experts == 2


NO_VLLM_IMPORT = """
import sys
from shardprep.demo.tiny import tiny_config
from shardprep.plan import archs
from shardprep.format.request import ConversionRequest
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel
import shardprep.convert.record  # the manifest's layout record knows the derived revision
config = tiny_config()
shapes = archs.target_family(config)[1].expected_shapes(config)
tensors = {n: ("BF16", s) for n, s in shapes.items()}
make_plan(SourceModel(config, tensors), ConversionRequest(tp=2, pp=2))
print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
"""


def test_planning_a_family_never_imports_vllm() -> None:
    """vLLM runs only in the deriving child: a family's plan (and convert's manifest code)
    works where vLLM is not installed, and costs nothing of it where it is."""
    out = subprocess.run(
        [sys.executable, "-c", NO_VLLM_IMPORT], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
