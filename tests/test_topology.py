from __future__ import annotations

import itertools

import pytest

from shardprep.errors import PlanError
from shardprep.topology import (
    default_partition,
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
