from __future__ import annotations

import itertools

import pytest

from shardprep.errors import PlanError
from shardprep.plan.topology import (
    ExpertSplit,
    default_partition,
    effective_placement,
    experts_of_rank,
    kv_heads_of_rank,
    make_topology,
    pad_vocab,
    parse_partition,
    rank_range,
)


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (32, 3, (11, 11, 10)),
        (10, 4, (2, 3, 3, 2)),
        (7, 4, (2, 2, 2, 1)),
        (61, 4, (15, 15, 16, 15)),
        (5, 2, (3, 2)),
        (4, 1, (4,)),
        (3, 3, (1, 1, 1)),
    ],
)
def test_default_partition_matches_vllm_examples(layers: int, pp: int, expected: tuple) -> None:
    assert default_partition(layers, pp) == expected


def test_default_partition_equals_vllm_get_pp_indices() -> None:
    vllm_utils = pytest.importorskip("vllm.distributed.utils")
    for layers in range(1, 40):
        for pp in range(1, min(layers, 9) + 1):
            sizes = default_partition(layers, pp)
            starts = [sum(sizes[:s]) for s in range(pp)]
            for stage in range(pp):
                expected = vllm_utils.get_pp_indices(layers, stage, pp)
                assert (starts[stage], starts[stage] + sizes[stage]) == tuple(expected)


def test_too_few_layers_for_pp() -> None:
    with pytest.raises(PlanError, match="fewer than pp=4"):
        default_partition(3, 4)


def test_explicit_partition_must_sum_to_layers() -> None:
    assert parse_partition("31,30", 61, 2) == (31, 30)
    with pytest.raises(PlanError, match="sums to 60 but the model has 61 layers"):
        parse_partition("30,30", 61, 2)
    with pytest.raises(PlanError, match="has 3 entries but pp=2"):
        parse_partition("20,20,21", 61, 2)
    with pytest.raises(PlanError, match="not a comma-separated list"):
        parse_partition("31;30", 61, 2)


def test_layer_ranges_and_stage_lookup() -> None:
    topo = make_topology(10, tp=2, pp=4)
    assert [topo.layer_range(s) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [topo.stage_of_layer(layer) for layer in (0, 1, 2, 7, 8, 9)] == [0, 0, 1, 2, 3, 3]


@pytest.mark.parametrize(
    ("vocab", "padded"), [(1000, 1024), (32000, 32000), (32001, 32064), (1, 64), (151936, 151936)]
)
def test_pad_vocab(vocab: int, padded: int) -> None:
    assert pad_vocab(vocab) == padded


def test_rank_range_tiles_without_gap() -> None:
    for size, tp in [(12, 3), (32064, 2), (64, 8)]:
        ranges = [rank_range(size, tp, r) for r in range(tp)]
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize(
    ("kv", "tp", "expected"),
    [
        (8, 2, [(0, 4), (4, 8)]),
        (2, 2, [(0, 1), (1, 2)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
        (1, 4, [(0, 1)] * 4),
        (4, 8, [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]),
    ],
)
def test_kv_heads_split_or_replicate(kv: int, tp: int, expected: list) -> None:
    assert [kv_heads_of_rank(kv, tp, r) for r in range(tp)] == expected


def test_kv_heads_that_do_not_divide() -> None:
    with pytest.raises(PlanError, match="not a multiple of the 3 KV heads"):
        kv_heads_of_rank(3, 4, 0)
    with pytest.raises(PlanError, match="not divisible by tp=4"):
        kv_heads_of_rank(6, 4, 0)


# Read off vLLM's determine_expert_map: remainder experts go to the FIRST ranks.
@pytest.mark.parametrize(
    ("experts", "ep", "linear", "round_robin"),
    [
        (10, 4, [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)], [(0, 4, 8), (1, 5, 9), (2, 6), (3, 7)]),
        (8, 2, [(0, 1, 2, 3), (4, 5, 6, 7)], [(0, 2, 4, 6), (1, 3, 5, 7)]),
        (7, 3, [(0, 1, 2), (3, 4), (5, 6)], [(0, 3, 6), (1, 4), (2, 5)]),
        (3, 5, [(0,), (1,), (2,), (), ()], [(0,), (1,), (2,), (), ()]),
    ],
)
def test_expert_placement_matches_vllm(
    experts: int, ep: int, linear: list[tuple[int, ...]], round_robin: list[tuple[int, ...]]
) -> None:
    assert [experts_of_rank(experts, ep, r, "linear") for r in range(ep)] == linear
    assert [experts_of_rank(experts, ep, r, "round_robin") for r in range(ep)] == round_robin


@pytest.mark.parametrize(
    ("experts", "ep"), list(itertools.product([1, 7, 60, 61, 256], [1, 3, 8, 16]))
)
def test_expert_placement_covers_every_expert_once(experts: int, ep: int) -> None:
    for placement in ("linear", "round_robin"):
        held = [experts_of_rank(experts, ep, r, placement) for r in range(ep)]
        assert sorted(e for rank in held for e in rank) == list(range(experts))
        assert max(map(len, held)) - min(map(len, held)) <= 1
        assert [len(h) for h in held] == sorted((len(h) for h in held), reverse=True)


def test_round_robin_only_where_vllm_applies_it() -> None:
    assert effective_placement("round_robin", num_expert_group=8, dp=1) == "round_robin"
    assert effective_placement("round_robin", num_expert_group=1, dp=1) == "linear"
    assert effective_placement("round_robin", num_expert_group=None, dp=1) == "linear"
    assert effective_placement("round_robin", num_expert_group=8, dp=2) == "linear"
    assert (
        effective_placement(
            "round_robin", num_expert_group=8, dp=2, all2all_backend="deepep_low_latency"
        )
        == "round_robin"
    )
    assert effective_placement("linear", num_expert_group=8, dp=1) == "linear"
    with pytest.raises(PlanError, match="expert placement 'random' is unknown"):
        effective_placement("random", num_expert_group=8, dp=1)


def test_expert_split_ranks() -> None:
    split = ExpertSplit(num_experts=10, tp=2, dp=2, expert_parallel=True)
    assert split.size == 4 and split.uses_ep
    assert [split.moe_rank(t, d) for d in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert split.experts(3) == (8, 9) and split.cut(3) == (1, 0)
    dense = ExpertSplit(num_experts=10, tp=2, dp=2)
    assert dense.experts(3) == tuple(range(10)) and dense.cut(3) == (4, 3)
    # vLLM turns EP off with a single MoE rank.
    single = ExpertSplit(num_experts=10, tp=1, expert_parallel=True)
    assert not single.uses_ep and single.cut(0) == (1, 0)
