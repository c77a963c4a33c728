"""The family registry: a table of plug-ins, drafts keyed by (method, target family),
every hook declared on the base classes, and each family with a layout revision."""

from __future__ import annotations

import argparse

import pytest

from shardprep.cli import build_parser
from shardprep.constants import DRAFT_SIDE_FILES
from shardprep.errors import ConfigError
from shardprep.format.vllm_layout import RANGES
from shardprep.plan import archs
from shardprep.plan.archs.base import DraftFamily, Family
from shardprep.plan.quant.fp8 import BlockQuant


def test_registering_a_name_twice_is_an_error() -> None:
    archs.register_target("LlamaForCausalLM", ".llama", "LlamaFamily")  # the same: nothing
    with pytest.raises(ConfigError) as info:
        archs.register_target("LlamaForCausalLM", ".mixtral", "MixtralFamily")
    assert str(info.value) == (
        "architecture 'LlamaForCausalLM' is registered twice: as ('.llama', 'LlamaFamily') "
        "and as ('.mixtral', 'MixtralFamily')"
    )
    with pytest.raises(ConfigError):
        archs.register_draft("mtp", "deepseek", ".llama", "EagleDraft")
    assert archs.target_family_of("LlamaForCausalLM").name == "llama"


def test_drafts_are_keyed_by_method_and_target_family() -> None:
    assert archs.draft_family("mtp", "deepseek").name == "deepseek_mtp"
    assert archs.draft_family("eagle3", "deepseek").name == "eagle3"  # any target
    with pytest.raises(ConfigError) as info:
        archs.draft_family("mtp", "llama")
    assert str(info.value) == (
        "draft method 'mtp' is not supported for a llama target; choose one of "
        "dflash, dspark, eagle, eagle3"
    )


def test_a_new_draft_family_for_another_target_does_not_replace_the_first() -> None:
    archs.register_draft("mtp", "mixtral", ".deepseek.mtp", "DeepseekMtpDraft")
    try:
        assert archs.draft_family("mtp", "deepseek") is archs.draft_family("mtp", "mixtral")
        with pytest.raises(ConfigError):
            archs.draft_family("mtp", "llama")
    finally:
        archs._DRAFTS.pop(("mtp", "mixtral"))


def test_every_family_is_a_declared_plug_in_with_a_layout_revision() -> None:
    families = archs.all_families()
    names = {family.name for family in families}
    assert names == {
        "llama", "qwen3_moe", "mixtral", "deepseek", "glm4_moe", "deepseek_v32",
        "eagle", "eagle3", "dflash", "dspark", "deepseek_mtp", "glm4_moe_mtp",
        "gpt_oss", "deepseek_v32_mtp", "deepseek_v4", "deepseek_v4_dspark", "kimi_k25", "kimi_k3",
        "kimi_k3_dspark", "kimi_k3_mtp",
        "qwen3_next", "qwen3_next_mtp",
        "qwen3_5_moe", "qwen3_5_moe_mtp",
        "derived",  # the MTP draft of a derived target
    }  # fmt: skip
    newest = RANGES[-1].revisions
    for family in families:
        assert isinstance(family, Family)
        assert family.name in newest, family.name
        assert family.quant_schemes <= set(newest), family.name
    assert BlockQuant.name in newest


def test_draft_side_files_are_the_ones_the_manifest_allows() -> None:
    drafts = [f for f in archs.all_families() if isinstance(f, DraftFamily)]
    assert {name for f in drafts for name in f.side_files} <= set(DRAFT_SIDE_FILES)
    assert any(f.side_files for f in drafts)


def test_the_cli_offers_the_registered_standalone_drafts() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("convert", "plan"):
        action = next(
            a for a in commands.choices[name]._actions if "--draft-method" in a.option_strings
        )
        assert list(action.choices) == archs.standalone_methods()
    assert archs.standalone_methods() == ["dflash", "dspark", "eagle", "eagle3"]
