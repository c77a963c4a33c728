"""A parameter of a fixed dtype (fp8 weights, float32 scales) takes only a source whose
values a copy into it keeps: any other is one line, not values cast into garbage."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile import rewrite_header

from shardprep.cli import main
from shardprep.demo.tiny import TINY_FP8, make_tiny_model
from shardprep.format.dtypes import keeps_values

WEIGHT = "model.layers.0.mlp.down_proj.weight"
SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("name", "relabeled", "held"),
    [(WEIGHT, "I8", "F8_E4M3"), (SCALE, "I32", "F32")],  # the same bytes, other values
)
def test_a_source_of_another_kind_is_refused(
    tmp_path: Path, capsys, name: str, relabeled: str, held: str
) -> None:
    model = make_tiny_model(
        tmp_path / "model", "DeepseekV3ForCausalLM", num_hidden_layers=2,
        quantization_config=TINY_FP8,
    )  # fmt: skip
    rewrite_header(model / "model.safetensors", lambda header: header[name].update(dtype=relabeled))
    assert main(["plan", str(model), "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        f"{name} is {relabeled} in the checkpoint, but vLLM holds {name} as {held}, and a copy "
        f"into it would change its values; use a checkpoint that stores {name} as {held}"
    ) in err


def test_what_a_copy_keeps() -> None:
    assert keeps_values("BF16", "F32") and keeps_values("F32", "BF16")  # vLLM's precision
    assert keeps_values("I32", "I64") and keeps_values("F8_E8M0", "U8")
    assert not keeps_values("BF16", "F8_E4M3") and not keeps_values("F8_E5M2", "F8_E4M3")
    assert not keeps_values("F32", "I32") and not keeps_values("I64", "I32")
