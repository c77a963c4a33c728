"""config.json read as vLLM reads it, through transformers' config classes: a checkpoint
whose config was saved by transformers 5 (keys renamed by the classes' attribute maps,
`dtype` for `torch_dtype`, `rope_parameters`) converts to the same rank files as the one
with the names each family was published with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model, tiny_config
from shardprep.errors import ConfigError
from shardprep.format.manifest import read_manifest
from shardprep.plan import archs
from shardprep.plan.archs.base import with_attribute_map

transformers = pytest.importorskip("transformers")

FAMILIES = {
    # architecture: tiny-model overrides (two layers keep the conversions quick)
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {},
    "Qwen3MoeForCausalLM": {},
    "MixtralForCausalLM": {},
    "DeepseekV2ForCausalLM": {},
    "DeepseekV3ForCausalLM": {"num_nextn_predict_layers": 1},
    "Glm4MoeForCausalLM": {"num_nextn_predict_layers": 1},
    "GptOssForCausalLM": {},
    "DeepseekV32ForCausalLM": {"num_nextn_predict_layers": 1},
    "KimiK25ForConditionalGeneration": {},  # the text model nested in text_config
    "Qwen3NextForCausalLM": {},
    "Qwen3_5MoeForConditionalGeneration": {},  # text_config and vision_config nested
}

# Model types vLLM reads with another transformers class than transformers' own
# (`_CONFIG_REGISTRY` in vllm/transformers_utils/config.py).
VLLM_CONFIG_CLASSES = {"deepseek_v32": "DeepseekV3Config"}
# Model types vLLM reads with a config class of its own, and that class's attribute_map:
# vLLM's `DeepseekV4Config` and `KimiK3Config` (transformers_utils/configs/) map nothing.
VLLM_OWN_CONFIG_MAPS: dict[str, dict[str, str]] = {"deepseek_v4": {}, "kimi_k3": {}}


def saved_by_transformers(model: Path, out: Path) -> dict:
    """A copy of `model` whose config.json is the one transformers' own config class of
    the model type writes (`save_pretrained`)."""
    shutil.copytree(model, out)
    config = json.loads((model / "config.json").read_text())
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    transformers.AutoConfig.for_model(config["model_type"], **kwargs).save_pretrained(out)
    return json.loads((out / "config.json").read_text())


def rank_bytes(artifact: Path) -> dict[str, bytes]:
    return {f.path: (artifact / f.path).read_bytes() for f in read_manifest(artifact).files}


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_a_config_saved_by_transformers_5_converts_to_the_same_rank_files(
    tmp_path: Path, architecture: str
) -> None:
    model = make_tiny_model(
        tmp_path / "model", architecture, num_hidden_layers=2, **FAMILIES[architecture]
    )
    saved = saved_by_transformers(model, tmp_path / "saved")
    assert "torch_dtype" not in saved and saved["transformers_version"].startswith("5.")
    if architecture == "Qwen3MoeForCausalLM":  # renamed by transformers 5
        assert "num_experts" not in saved and saved["num_local_experts"] == 8
    options = Options(tp=2, pp=2)
    convert(str(model), tmp_path / "a", options, progress=False)
    convert(str(tmp_path / "saved"), tmp_path / "b", options, progress=False)
    ours, theirs = rank_bytes(tmp_path / "a"), rank_bytes(tmp_path / "b")
    assert ours and ours == theirs


def test_every_family_maps_what_its_transformers_config_class_maps() -> None:
    """Each family's table is its config classes' attribute_map, model type by model type."""
    for architecture in archs.supported()[0]:
        model_type = tiny_config(architecture)["model_type"]
        mapping = archs.target_family_of(architecture).attribute_maps.get(model_type, {})
        if model_type in VLLM_OWN_CONFIG_MAPS:
            assert dict(mapping) == VLLM_OWN_CONFIG_MAPS[model_type], architecture
            continue
        if model_type in VLLM_CONFIG_CLASSES:
            cls = getattr(transformers, VLLM_CONFIG_CLASSES[model_type])
        else:
            cls = type(transformers.AutoConfig.for_model(model_type))
        assert dict(mapping) == cls.attribute_map, architecture


def test_either_name_of_a_mapped_key_is_read_and_two_values_are_one_line() -> None:
    mapping = {"num_experts": "num_local_experts"}
    assert with_attribute_map({"num_local_experts": 8}, mapping)["num_experts"] == 8
    assert with_attribute_map({"num_experts": 8}, mapping)["num_local_experts"] == 8
    assert with_attribute_map({"num_experts": 8, "num_local_experts": 8}, mapping) == {
        "num_experts": 8,
        "num_local_experts": 8,
    }
    with pytest.raises(ConfigError) as info:
        with_attribute_map({"num_experts": 8, "num_local_experts": 4}, mapping)
    assert str(info.value) == (
        "config.json has num_experts: 8 and num_local_experts: 4, which transformers reads "
        "as one setting; keep one of them"
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
KEYS = st.sampled_from(["num_experts", "num_local_experts", "n_routed_experts", "other"])


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, JSON, max_size=4))
def test_any_config_reads_with_both_names_or_fails_with_one_line(config: dict) -> None:
    mapping = {"num_experts": "num_local_experts", "n_routed_experts": "other"}
    try:
        found = with_attribute_map(config, mapping)
    except ConfigError as exc:
        assert "\n" not in str(exc) and "keep one of them" in str(exc)
        return
    for attribute, key in mapping.items():
        given = [config[n] for n in (attribute, key) if config.get(n) is not None]
        if given:
            assert found[attribute] == found[key] == given[0]
        else:
            assert (found.get(attribute), found.get(key)) == (
                config.get(attribute),
                config.get(key),
            )
