"""The region arithmetic that cuts a rank of a coarser tp out of an artifact's rank
tensors: for every cut and odd sizes, the tensors assembled from the artifact's blocks
equal the ones the plan cuts straight from the source, and each block is read once."""

from __future__ import annotations

import numpy as np
import pytest
from regrouping import DTYPE, assemble

from shardprep.errors import PlanError
from shardprep.plan.cuts import Cut, Piece, ScaleOf
from shardprep.plan.experts import w2_pieces, w13_pieces
from shardprep.plan.regions import (
    expert_ranks_for,
    locate,
    rank_tensor,
    served_tps,
    stages_for,
    stored_blocks,
    tp_ranks_for,
    worker_stages,
)
from shardprep.plan.topology import ExpertSplit, Topology

_RNG = np.random.default_rng(21)


def _random(*shape: int) -> np.ndarray:
    return _RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1), (8, 4), (8, 1)])
def test_a_deltanet_conv1d_cut_into_q_k_and_v_rows_at_every_coarser_tp(
    tp: int, new_tp: int
) -> None:
    """A coarser rank's q, k and v rows are each made of several artifact ranks' rows."""
    sources = {"conv": _random(8 + 8 + 16, 1, 4)}
    pieces = (Piece("conv", Cut.QKV_ROWS, heads=8),)
    for rank in range(new_tp):
        got, want, _ = assemble(pieces, sources, tp, new_tp, rank)
        assert np.array_equal(got, want), rank


@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1), (8, 4), (8, 2), (8, 1)])
def test_dense_cuts_at_every_coarser_tp(tp: int, new_tp: int) -> None:
    hidden, heads_dim = 24, 3
    sources = {
        "q": _random(48, hidden),
        "k": _random(2 * heads_dim, hidden),  # 2 KV heads: replicated when tp > 2
        "v": _random(2 * heads_dim, hidden),
        "o": _random(hidden, 48),
        "embed": _random(101, hidden),  # padded to 128 rows, then split
        "norm": _random(hidden),
        "bias": _random(48),
        "wqkv": _random(3 * 48, hidden),  # MoonViT's fused q, k, v
        "gqa": _random(48 + 2 * 2 * heads_dim, hidden),  # a fused q, k, v of 16 and 2 heads
    }
    cases = {
        "qkv": (
            Piece("q", Cut.ROWS),
            Piece("k", Cut.KV_HEADS, heads=2),
            Piece("v", Cut.KV_HEADS, heads=2),
        ),
        "o": (Piece("o", Cut.COLS),),
        "embed": (Piece("embed", Cut.VOCAB),),
        "lm_head_padded": (Piece("embed", Cut.PADDED_VOCAB),),
        "norm": (Piece("norm", Cut.REPLICATE),),
        "bias": (Piece("bias", Cut.ROWS),),
        "wqkv": (Piece("wqkv", Cut.PARTS_ROWS, heads=3),),
        "gqa": (Piece("gqa", Cut.QKV_HEADS, heads=2, q_heads=16),),
    }
    for name, pieces in cases.items():
        for rank in range(new_tp):
            got, want, _ = assemble(pieces, sources, tp, new_tp, rank)
            assert np.array_equal(got, want), (name, rank)


@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1)])
def test_block_scales_on_odd_edges(tp: int, new_tp: int) -> None:
    # A 512 x 320 weight in 128 x 128 blocks: 4 x 3 scales, the last column partial.
    sources = {"s": _random(4, 3), "t": _random(4, 3)}
    rows = (Piece("s", Cut.BLOCK_SCALE, scale_of=ScaleOf((512, 320), Cut.ROWS, (128, 128))),)
    cols = (Piece("t", Cut.BLOCK_SCALE, scale_of=ScaleOf((320, 512), Cut.COLS, (128, 128))),)
    sources["t"] = _random(3, 4)
    for pieces in (rows, cols):
        for rank in range(new_tp):
            got, want, _ = assemble(pieces, sources, tp, new_tp, rank)
            assert np.array_equal(got, want)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1)])
def test_expert_stacks(tp: int, new_tp: int, expert_parallel: bool) -> None:
    experts = 6  # not a multiple of 4: EP ranks hold 2, 2, 1, 1 at ep 4
    sources = {}
    for e in range(experts):
        sources[f"g{e}"], sources[f"u{e}"] = _random(8, 5), _random(8, 5)
        sources[f"d{e}"] = _random(5, 8)
    w13 = w13_pieces([(f"g{e}", f"u{e}") for e in range(experts)])
    w2 = w2_pieces([f"d{e}" for e in range(experts)])
    split = (
        ExpertSplit(experts, tp, expert_parallel=expert_parallel),
        ExpertSplit(experts, new_tp, expert_parallel=expert_parallel),
    )
    for pieces in (w13, w2):
        for rank in range(new_tp):
            got, want, _ = assemble(pieces, sources, tp, new_tp, rank, split)
            assert got.shape == want.shape
            assert np.array_equal(got, want)


@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1), (8, 2)])
def test_fused_expert_tensors_transposed_as_gpt_oss_stacks_them(tp: int, new_tp: int) -> None:
    # gpt-oss's [E, H, 2I] gate_up, [E, I, H] down and their biases; 3 experts, I = 8.
    experts, hidden, inter = 3, 5, 8
    sources = {
        "gate_up": _random(experts, hidden, 2 * inter),
        "down": _random(experts, inter, hidden),
        "gate_up_bias": _random(experts, 2 * inter),
        "down_bias": _random(experts, hidden),
    }
    cuts = {
        "gate_up": Cut.EXPERT_COLS_T,
        "down": Cut.EXPERT_ROWS_T,
        "gate_up_bias": Cut.EXPERT_ROW,
        "down_bias": Cut.EXPERT_ROW_FIRST,
    }
    split = (ExpertSplit(experts, tp), ExpertSplit(experts, new_tp))
    for source, cut in cuts.items():
        pieces = tuple(Piece(source, cut, expert=e) for e in range(experts))
        for rank in range(new_tp):
            got, want, _ = assemble(pieces, sources, tp, new_tp, rank, split)
            assert got.shape == want.shape
            assert np.array_equal(got, want), (source, rank)


@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1), (8, 2)])
def test_expert_stacks_as_transformers_5_stores_them(tp: int, new_tp: int) -> None:
    """[E, 2I, H] `gate_up_proj` (the rank's rows of each half) and [E, H, I] `down_proj`
    (its columns): a coarser rank's matrix of each expert is tiled by the artifact's."""
    experts, hidden, inter = 3, 5, 16
    sources = {
        "gate_up": _random(experts, 2 * inter, hidden),
        "down": _random(experts, hidden, inter),
    }
    split = (ExpertSplit(experts, tp), ExpertSplit(experts, new_tp))
    for source, cut in (("gate_up", Cut.EXPERT_HALVES_ROWS), ("down", Cut.EXPERT_COLS)):
        pieces = tuple(Piece(source, cut, expert=e) for e in range(experts))
        for rank in range(new_tp):
            got, want, _ = assemble(pieces, sources, tp, new_tp, rank, split)
            assert got.shape == want.shape
            assert np.array_equal(got, want), (source, rank)


@pytest.mark.parametrize(("align", "served"), [(32, True), (64, False)])
def test_mxfp4_experts_at_a_coarser_tp_unless_padded_for_their_tp(align: int, served: bool) -> None:
    """MXFP4 slabs that fill their matrix tile like any part of it; padded ones (the MoE
    backend's alignment of the intermediate size: 32 a rank at tp4 padded to 64) are only
    ever the very same block."""
    experts, hidden, inter, per = 2, 64, 128, 2  # values per stored element
    of = ScaleOf((2 * inter, hidden), Cut.REPLICATE, (1, per), grid=(align, 1))
    down = ScaleOf((hidden, inter), Cut.REPLICATE, (1, per), grid=(align, 1))
    sources = {
        "w13": _random(experts, 2 * inter, hidden // per),
        "w2": _random(experts, hidden, inter // per),
    }
    split = (ExpertSplit(experts, 4), ExpertSplit(experts, 2))
    for source, cut, scale in (("w13", Cut.MX_W13, of), ("w2", Cut.MX_W2, down)):
        pieces = tuple(Piece(source, cut, expert=e, scale_of=scale) for e in range(experts))
        if not served:
            with pytest.raises(PlanError, match="not whole blocks"):
                assemble(pieces, sources, 4, 2, 0, split)
            continue
        for rank in range(2):
            got, want, _ = assemble(pieces, sources, 4, 2, rank, split)
            assert np.array_equal(got, want), (source, rank)


def test_a_tp_that_does_not_divide_is_not_whole_blocks() -> None:
    sources = {"q": _random(12, 4)}
    pieces = (Piece("q", Cut.ROWS),)
    with pytest.raises(PlanError, match=r"rows 0-3 of q are not whole blocks"):
        assemble(pieces, sources, 2, 3, 0)


def test_replicated_tensors_are_read_from_the_rank_itself() -> None:
    shapes = {"n": (7,)}
    pieces = (Piece("n", Cut.REPLICATE),)
    art = {f"tp{r}": rank_tensor("n", pieces, shapes, DTYPE, 4, r) for r in range(4)}
    stored = [s for h, t in art.items() for s in stored_blocks(h, t)]
    reads, _ = locate(rank_tensor("n", pieces, shapes, DTYPE, 2, 1), stored, ["tp2", "tp3"])
    assert [r.holder for r in reads] == ["tp2"]


def test_served_tps() -> None:
    assert served_tps(8) == (1, 2, 4, 8)
    assert served_tps(6) == (1, 2, 3, 6)
    assert served_tps(1) == (1,)


@pytest.mark.parametrize(
    ("partition", "new", "wanted"),
    [
        ((3, 3), (2, 2, 2), [(0,), (0, 1), (1,)]),
        ((3, 4), (7,), [(0, 1)]),
        ((7,), (2, 3, 2), [(0,), (0,), (0,)]),
        ((2, 3, 2), (4, 3), [(0, 1), (1, 2)]),
        ((1, 1, 1, 1, 1), (1, 3, 1), [(0,), (1, 2, 3), (4,)]),
        ((4, 4), (4, 4), [(0,), (1,)]),
    ],
)
def test_stages_for_another_pipeline_split(
    partition: tuple[int, ...], new: tuple[int, ...], wanted: list[tuple[int, ...]]
) -> None:
    artifact = Topology(2, len(partition), partition)
    assert [stages_for(artifact, new, stage) for stage in range(len(new))] == wanted


def test_stages_for_refuses_a_split_of_another_model_or_stage() -> None:
    artifact = Topology(2, 2, (3, 3))
    with pytest.raises(PlanError, match="has 5 layers, the artifact's model 6"):
        stages_for(artifact, (2, 3), 0)
    with pytest.raises(PlanError, match="stage 3 is not one of the 3 stages"):
        stages_for(artifact, (2, 2, 2), 3)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 12])
def test_tp_ranks_for_tile_the_artifact_ranks_in_order(tp: int) -> None:
    ranks = [list(tp_ranks_for(12, tp, r)) for r in range(tp)]
    assert [r for run in ranks for r in run] == list(range(12))
    assert {len(r) for r in ranks} == {12 // tp}


def test_tp_ranks_for_refuses_a_tp_that_does_not_divide_or_a_rank_outside() -> None:
    with pytest.raises(PlanError, match="tp4 is not a divisor of the artifact's tp6"):
        tp_ranks_for(6, 4, 0)
    with pytest.raises(PlanError, match="rank 3 is not one of the 3 ranks of tp3"):
        tp_ranks_for(6, 3, 3)


def test_worker_stages_put_a_draft_on_the_artifact_last_stage() -> None:
    artifact = Topology(2, 3, (2, 2, 2))
    assert worker_stages(artifact, (6,), 0) == (0, 1, 2)
    assert worker_stages(artifact, (3, 3), 0) == (0, 1)
    assert worker_stages(artifact, (3, 3), 1, draft=True) == (2,)
    assert worker_stages(artifact, (6,), 0, draft=True) == (2,)


RR = "round_robin"


@pytest.mark.parametrize(
    ("stored", "running", "moe_rank", "ranks"),
    [
        (ExpertSplit(8, 4), ExpertSplit(8, 2), 1, (2, 3)),  # cuts of every expert, tp-wise
        (ExpertSplit(8, 4), ExpertSplit(8, 1), 0, (0, 1, 2, 3)),
        (ExpertSplit(8, 6), ExpertSplit(8, 3), 2, (4, 5)),
        (ExpertSplit(10, 4, 1, True), ExpertSplit(10, 2, 1, True), 0, (0, 1)),  # 3, 3, 2, 2
        (ExpertSplit(10, 4, 1, True), ExpertSplit(10, 2, 1, True), 1, (1, 2, 3)),  # 5 and 5
        (ExpertSplit(12, 6, 1, True), ExpertSplit(12, 4, 1, True), 1, (1, 2)),
        (ExpertSplit(8, 4, 1, True, RR), ExpertSplit(8, 2, 1, True, RR), 1, (1, 3)),
        (ExpertSplit(8, 2, 2, True), ExpertSplit(8, 2, 1, True), 1, (2, 3)),  # dp rank 1's
        (ExpertSplit(8, 4), ExpertSplit(8, 2, 1, True), 0, (0, 1, 2, 3)),  # EP on one side
        (ExpertSplit(8, 4, 1, True), ExpertSplit(8, 2), 1, (0, 1, 2, 3)),
    ],
)
def test_expert_ranks_for_a_coarser_rank(
    stored: ExpertSplit, running: ExpertSplit, moe_rank: int, ranks: tuple[int, ...]
) -> None:
    """The artifact MoE ranks a rank's experts come from: tp_ranks_for's without expert
    parallelism, the EP ranks of its experts with it on both sides, every rank across."""
    assert expert_ranks_for(stored, running, moe_rank) == ranks


def test_expert_ranks_for_other_expert_counts_is_refused() -> None:
    with pytest.raises(PlanError, match="vLLM runs 16 experts per layer, the artifact holds 8"):
        expert_ranks_for(ExpertSplit(8, 2), ExpertSplit(16, 1), 0)


@pytest.mark.parametrize(("tp", "new_tp"), [(2, 1), (4, 2), (4, 1)])
def test_packed_int4_expert_stacks(tp: int, new_tp: int) -> None:
    """int4 experts (compressed-tensors): 256 columns of down_proj packed 8 to an int32 (32)
    and scaled per group of 32 (8), gate and up rows whole; every cut at tp' from tp."""
    experts, inter, hidden = 3, 256, 64
    sources, w13, w2 = {}, [], []
    for e in range(experts):
        for part, shape in (("g", (inter, hidden)), ("u", (inter, hidden)), ("d", (hidden, inter))):
            for kind, per in (("p", 8), ("s", 32)):
                name = f"{part}{e}{kind}"
                sources[name] = _random(shape[0], shape[1] // per)
                of = ScaleOf(shape, Cut.COLS if part == "d" else Cut.ROWS, (1, per))
                piece = Piece(name, Cut.PACKED, expert=e, scale_of=of)
                (w2 if part == "d" else w13).append((kind, piece))
    split = (ExpertSplit(experts, tp), ExpertSplit(experts, new_tp))
    for stack in (w13, w2):
        for kind in ("p", "s"):
            pieces = tuple(piece for k, piece in stack if k == kind)
            for rank in range(new_tp):
                got, want, _ = assemble(pieces, sources, tp, new_tp, rank, split)
                assert got.shape == want.shape
                assert np.array_equal(got, want)
