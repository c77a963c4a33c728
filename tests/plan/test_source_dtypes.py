"""A parameter vLLM holds in floating point needs a floating-point source (or one the
family declares quantized); an index table vLLM holds as integers is stored as vLLM
holds it. Both are decided before the first write."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import tiny_config
from shardprep.errors import PlanError
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.make import make_plan
from shardprep.plan.records import SourceModel


def source(config: dict, **dtypes: str) -> SourceModel:
    shapes = archs.target_family(config)[1].expected_shapes(config)
    return SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})


@pytest.mark.parametrize("dtype", ["I16", "I32", "U8", "BOOL"])
def test_an_integer_lm_head_is_refused_before_anything_is_written(dtype: str) -> None:
    config = tiny_config("LlamaForCausalLM")
    with pytest.raises(PlanError) as info:
        make_plan(source(config, **{"lm_head.weight": dtype}), ConversionRequest(tp=1, pp=1))
    assert str(info.value) == (
        f"cannot convert: target: lm_head.weight is {dtype} in the checkpoint, but vLLM holds "
        "lm_head.weight as a floating-point parameter; use a checkpoint whose weights are "
        "floating point"
    )


def test_an_integer_source_is_refused_by_convert_with_nothing_written(tiny, tmp_path: Path) -> None:
    model = tmp_path / "model"
    original = tiny.model("int-lm-head")
    model.mkdir()
    for file in original.iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight"] = (
        tensors["lm_head.weight"].mul(100).to(dtype=__import__("torch").int16)
    )
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(PlanError, match="lm_head.weight is I16"):
        convert(str(model), tmp_path / "out", Options(tp=1, pp=1), progress=False)
    assert not (tmp_path / "out").exists()


def test_an_eagle3_draft_to_target_table_is_held_as_vllm_holds_it(tiny) -> None:
    target_config = tiny_config("LlamaForCausalLM")
    draft = archs.draft_family("eagle3", "llama")
    config = {"draft_vocab_size": 64}
    shapes = draft.expected_shapes(config, PlanContext(target_config=target_config))
    tensors = {n: ("BF16", s) for n, s in shapes.items()} | {"d2t": ("I32", shapes["d2t"])}
    plan = make_plan(
        source(target_config),
        ConversionRequest(tp=1, pp=1, draft_method="eagle3"),
        SourceModel(config, tensors),
    )
    d2t = [t for f in plan.files if f.role == "draft" for t in f.tensors if t.name.endswith("d2t")]
    table = next(t for f in plan.files for t in f.tensors if t.name == "draft_id_to_target_id")
    assert not d2t and table.dtype == "I64"  # vLLM's torch.long, whatever the checkpoint had
