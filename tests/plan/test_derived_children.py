"""The deriving children (plan/derived/children.py): a large derivation's ranks are shared
among children, one a core, and the layout they give is the one child's."""

from __future__ import annotations

import pytest

from shardprep.demo.tiny import tiny_config
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.derived import available, children, run
from shardprep.plan.derived.placeholders import placeholders
from shardprep.plan.topology import make_topology


@pytest.mark.parametrize(
    "ranks, tensors, cores, wanted, count",
    [
        (16, 45_395, 2, "", 2),  # DeepSeek-V3's table at tp8 x pp2: one a core
        (16, 45_395, 16, "", children.MAX_CHILDREN),
        (4, 300, 16, "", 1),  # a tiny model: not worth another import of vLLM
        (4, 300, 16, "3", 3),  # asked for
        (2, 300, 16, "3", 2),  # never more than the ranks
        (4, 300, 16, "0", 1),  # not a count: the default
    ],
)
def test_children_are_one_a_core_for_a_large_derivation(
    monkeypatch: pytest.MonkeyPatch, ranks: int, tensors: int, cores: int, wanted: str, count: int
) -> None:
    monkeypatch.setattr(children.os, "cpu_count", lambda: cores)
    monkeypatch.setenv(children.CHILDREN, wanted)
    assert children.how_many(ranks, tensors) == count


@pytest.mark.vllm
@pytest.mark.skipif(not available(), reason="deriving needs vLLM installed")
def test_ranks_shared_among_two_children_give_the_layout_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    published = tiny_config("Qwen3MoeForCausalLM")
    config = archs.read_config(published)
    family = archs.target_family(config)[1]
    tensors = placeholders(quantized.expected_shapes(family, config), {}, "BF16")
    topology = make_topology(config["num_hidden_layers"], 2, 2, None, "")
    layouts = []
    for count in ("1", "2"):
        monkeypatch.setenv(children.CHILDREN, count)
        layouts.append(run.derive(published, tensors, topology, "bfloat16", progress=False)[0])
    assert layouts[0] == layouts[1]
    assert len(layouts[0].params) > 10
