"""Every quantization scheme keeps its declarations (plan/quant/base.py): an example for
each tensor it stores, which the demo makes in the stored shape and dtype, and a declared
ending for each parameter it builds; the selection table is a registry like the
families'."""

from __future__ import annotations

import pytest
import torch

from shardprep.demo.quantized import quantized_tensors
from shardprep.demo.tiny import (
    TINY_FP8,
    TINY_FP8_CT,
    TINY_INT4,
    TINY_MODELOPT_NVFP4,
    TINY_MXFP4,
    TINY_MXFP4_PACK,
    TINY_NVFP4,
    TINY_NVFP4A16,
)
from shardprep.errors import ConfigError
from shardprep.format.dtypes import safetensors_name
from shardprep.plan.archs.deepseek_v4.quant import ROUTED
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.quant import all_schemes, register_scheme, scheme_of
from shardprep.plan.quant.base import EXAMPLE_KINDS, PLAIN, Scheme
from shardprep.plan.quant.fp4 import GROUP, Mxfp4PackMoeQuant
from shardprep.plan.quant.fp8_mxfp4 import Fp8Mxfp4Quant

PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
LINEAR = "model.layers.0.mlp.down_proj.weight"
EXPERT = "layers.0.ffn.experts.3.w2.weight"  # DeepSeek-V4's MXFP4 expert
FUSED = "model.layers.0.mlp.experts.gate_up_proj"  # gpt-oss's [E, H, 2I]


def _read(quant: dict) -> Scheme:
    scheme = scheme_of({"quantization_config": quant})
    assert scheme is not None and not scheme.problem, quant
    return scheme


def schemes() -> list[Scheme]:
    """One of every registered scheme, as config.json or a family selects it."""
    return [
        *(_read(q) for q in (TINY_FP8, PER_TENSOR, TINY_FP8_CT, TINY_INT4, TINY_MXFP4_PACK)),
        *(_read(q) for q in (TINY_NVFP4, TINY_NVFP4A16, TINY_MODELOPT_NVFP4, TINY_MXFP4)),
        Mxfp4PackMoeQuant(GROUP),
        Fp8Mxfp4Quant((128, 128), experts_pattern=ROUTED),
    ]


def weights(scheme: Scheme) -> dict[str, tuple[int, ...]]:
    """Weights the scheme stores quantized, with their own shapes."""
    if scheme.name == "mxfp4":
        return {FUSED: (4, 64, 256)}
    if isinstance(scheme, Fp8Mxfp4Quant):
        return {LINEAR: (256, 512), EXPERT: (256, 512)}
    return {LINEAR: (256, 512)}


def test_every_registered_scheme_is_exercised_here() -> None:
    assert {type(s) for s in schemes()} == set(all_schemes())


@pytest.mark.parametrize("scheme", schemes(), ids=lambda s: f"{type(s).__name__}")
def test_a_scheme_declares_an_example_of_each_tensor_it_stores(scheme: Scheme) -> None:
    for weight, shape in weights(scheme).items():
        stored = scheme.stored(weight, shape)
        examples = scheme.examples(weight, shape)
        written = [other for example in examples.values() for other in example.writes]
        assert sorted([*examples, *written]) == sorted(stored), weight
        for name, example in examples.items():
            assert example.kind in EXAMPLE_KINDS
            assert (example.kind == PLAIN) is (stored[name][1] == ""), name


@pytest.mark.parametrize("scheme", schemes(), ids=lambda s: f"{type(s).__name__}")
def test_the_demo_makes_each_example_in_the_stored_shape_and_dtype(scheme: Scheme) -> None:
    stored = {n: v for w, s in weights(scheme).items() for n, v in scheme.stored(w, s).items()}
    examples = {n: e for w, s in weights(scheme).items() for n, e in scheme.examples(w, s).items()}
    dtypes = {name: dtype for name, (_, dtype) in stored.items() if dtype}
    placeholders = {name: torch.zeros(shape) for name, (shape, _) in stored.items()}
    made = quantized_tensors(placeholders, dtypes, examples, seed=0)
    assert sorted(made) == sorted(dtypes)
    for name, tensor in made.items():
        assert (tuple(tensor.shape), safetensors_name(tensor.dtype)) == stored[name], name
    again = quantized_tensors(placeholders, dtypes, examples, seed=0)
    for name, tensor in made.items():  # the same bytes from the same seed
        assert torch.equal(_bytes(again[name]), _bytes(tensor)), name


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _pieces(scheme: Scheme, weight: str) -> tuple[str, tuple[Piece, ...]]:
    if weight == FUSED:
        return "model.layers.0.mlp.experts.w13_weight", (Piece(weight, Cut.EXPERT_COLS_T),)
    if weight == EXPERT:
        return "layers.0.ffn.experts.w2_weight", (Piece(weight, Cut.COLS, expert=3),)
    return weight.replace("down_proj", "o_proj"), (Piece(weight, Cut.COLS),)


@pytest.mark.parametrize("scheme", schemes(), ids=lambda s: f"{type(s).__name__}")
def test_every_parameter_a_scheme_builds_ends_as_it_declares(scheme: Scheme) -> None:
    for weight, shape in weights(scheme).items():
        name, pieces = _pieces(scheme, weight)
        params, _ = scheme.params(name, pieces, {weight: shape}, 2, 2)
        built = [param for param, _, _ in params if param != name]
        assert built, weight
        for param in built:
            assert param.endswith(scheme.param_suffixes), (param, scheme.param_suffixes)


def test_a_scheme_registers_once_and_a_second_entry_is_refused() -> None:
    register_scheme("fp8", "*", "fp8", "fp8_quant")  # the same entry again: nothing
    with pytest.raises(ConfigError, match=r"quantization \('fp8', '\*'\) is registered twice"):
        register_scheme("fp8", "*", "int4", "pack_quant")


def test_the_table_selects_by_method_and_format() -> None:
    assert scheme_of({}) is None
    assert scheme_of({"quantization_config": TINY_MXFP4_PACK}).name == "mxfp4_pack"  # type: ignore[union-attr]
    odd = scheme_of({"quantization_config": {**TINY_INT4, "format": "marlin-24"}})
    assert odd is not None and "format 'marlin-24'" in odd.problem
    modelopt = scheme_of(
        {"quantization_config": {**TINY_MODELOPT_NVFP4, "quant_method": "MODELOPT_FP4"}}
    )
    assert modelopt is not None and modelopt.name == "modelopt_fp4" and not modelopt.problem
    other = scheme_of({"quantization_config": {"quant_method": "awq"}})
    assert other is not None and other.problem.startswith(
        "quantization_config has quant_method 'awq'; "
    )
