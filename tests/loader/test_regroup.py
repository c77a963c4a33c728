"""Cutting a rank of another topology out of an artifact (no engine): each tensor equals,
byte for byte, what a conversion made straight at that topology holds, every byte read
once, only the files of the stages that hold it; what cannot be served is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shardprep.convert.run import Options, convert
from shardprep.demo.quant_configs import (
    KIMI_K3_MXFP4,
    TINY_FP8_CT,
    TINY_INT4,
    TINY_MODELOPT_NVFP4,
    TINY_NVFP4,
)
from shardprep.demo.tiny import TINY_FP8, TINY_MXFP4, make_tiny_draft, make_tiny_model
from shardprep.errors import TopologyMismatchError
from shardprep.format.manifest import Manifest, read_manifest
from shardprep.hub.cache_parts import worker_expert_ranks
from shardprep.loader.reader import read_rank
from shardprep.loader.regroup import ReadCount, check_served, regroup_rank
from shardprep.plan.regions import tp_ranks_for, worker_stages
from shardprep.plan.topology import ExpertSplit
from shardprep.report import artifact_summary


def _convert(source: Path, out: Path, tp: int, pp: int, **options: object) -> Manifest:
    return convert(str(source), out, Options(tp=tp, pp=pp, **options), progress=False)


def _compare(
    artifact: Path, reference: Path, role: str, ep: bool = False, dp: int = 1
) -> list[float]:
    """Every rank of `reference`, cut out of `artifact`; returns read / own per rank."""
    ref, manifest = read_manifest(reference), read_manifest(artifact)
    entry = manifest.model(role)
    assert entry is not None
    ratios = []
    topo = ref.topology
    for pp_rank in ref.stages:
        for tp_rank in range(topo.tp):
            if not ref.rank_files(role, pp_rank, tp_rank):
                continue
            want = dict(read_rank(reference, role, pp_rank, tp_rank, manifest=ref))
            experts = None
            if entry.experts is not None:
                split = ExpertSplit(entry.experts.num_experts, topo.tp, dp, ep, "linear")
                experts = (split, split.moe_rank(tp_rank))
            count = ReadCount()
            art = manifest.topology
            stages = worker_stages(art, topo.partition, pp_rank, draft=role == "draft")
            got = dict(
                regroup_rank(
                    artifact,
                    manifest,
                    entry,
                    sorted(want),
                    tp=topo.tp,
                    tp_rank=tp_rank,
                    experts=experts,
                    count=count,
                    stages=stages,
                )
            )
            assert sorted(got) == sorted(want)
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype, name
                assert got[name].shape == tensor.shape, name
                assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
            # Only the stages of this rank's layers and the tp ranks this rank is made of,
            # with those that hold its experts: what a worker fetches from the Hub.
            opened = [Path(f).name.split("-") for f in count.files]
            assert {int(name[2]) for name in opened} <= set(stages)
            ranks = {*tp_ranks_for(art.tp, topo.tp, tp_rank)}
            held = worker_expert_ranks(manifest, "org/repo", role, lambda _, e=experts: e)
            assert held is not None
            ranks |= set(held)
            assert {int(name[4]) for name in opened} == ranks
            ratios.append(count.read / count.own)
    return ratios


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("dense")
    target = make_tiny_model(root / "llama", num_hidden_layers=4)
    draft = make_tiny_draft(root / "eagle3", target)
    artifact = root / "tp2-pp2"
    _convert(target, artifact, 2, 2, draft=str(draft))
    return target, draft, artifact


@pytest.mark.parametrize(("tp", "pp", "partition"), [(1, 1, None), (2, 1, None), (1, 2, None),
                                                     (1, 4, None), (2, 3, "1,2,1")])  # fmt: skip
def test_dense_with_a_draft_at_every_served_topology(
    dense: tuple[Path, Path, Path], tmp_path: Path, tp: int, pp: int, partition: str | None
) -> None:
    target, draft, artifact = dense
    reference = tmp_path / "ref"
    _convert(target, reference, tp, pp, draft=str(draft), partition=partition)
    for role in ("target", "draft"):
        ratios = _compare(artifact, reference, role)
        assert ratios and set(ratios) == {1.0}


@pytest.mark.parametrize(
    ("made", "served"),
    [
        ({}, {}),
        ({"expert_parallel": True}, {}),
        ({"expert_parallel": True, "dp": 2}, {}),  # experts stored per dp rank
        ({"expert_parallel": True}, {"tp": 2, "pp": 1, "expert_parallel": True}),
        ({"tp": 4, "pp": 1, "expert_parallel": True}, {"tp": 2, "pp": 2, "expert_parallel": True}),
        ({"tp": 4, "pp": 1}, {"tp": 2, "pp": 2}),  # each rank's experts from two ranks
        ({"tp": 4, "pp": 1}, {"tp": 2, "pp": 1, "expert_parallel": True}),  # from all four
    ],
    ids=["tp", "ep", "ep-dp2", "ep-to-ep", "ep4-to-ep2", "tp4-to-tp2", "tp4-to-ep2"],
)
def test_moe_experts_at_a_coarser_tp(tmp_path: Path, made: dict, served: dict) -> None:
    target = make_tiny_model(tmp_path / "moe", "Qwen3MoeForCausalLM")
    artifact, reference = tmp_path / "made", tmp_path / "served"
    _convert(target, artifact, **{"tp": 2, "pp": 2, **made})
    _convert(target, reference, **{"tp": 1, "pp": 1, **served})
    ep = served.get("expert_parallel", False)
    assert set(_compare(artifact, reference, "target", ep=ep)) == {1.0}


def test_whole_experts_are_not_cut_for_a_run_without_expert_parallelism(tmp_path: Path) -> None:
    """An expert-parallel artifact holds whole experts: vLLM without EP takes them whole
    at tp1, and at tp2 would need half of each, which no rank file holds."""
    target = make_tiny_model(tmp_path / "moe", "Qwen3MoeForCausalLM")
    artifact = tmp_path / "ep"
    made = _convert(target, artifact, 2, 2, expert_parallel=True)
    assert made.served_topologies() == (
        "tp 1, 2 x any pp (tp 2 with --enable-expert-parallel: each rank holds whole experts)"
    )
    assert artifact_summary(made)["whole_experts"] is True
    assert artifact_summary(_convert(target, tmp_path / "cut", 2, 2))["whole_experts"] is False
    _convert(target, tmp_path / "tp1", 1, 1)
    assert set(_compare(artifact, tmp_path / "tp1", "target")) == {1.0}
    _convert(target, tmp_path / "tp2", 2, 1)
    with pytest.raises(TopologyMismatchError) as info:
        _compare(artifact, tmp_path / "tp2", "target")
    assert str(info.value) == (
        f"artifact {artifact} holds whole experts on each rank (converted with "
        "--enable-expert-parallel) but vLLM runs tp2 without expert parallelism, which cuts "
        "every expert 2 ways; start vLLM with --enable-expert-parallel (or at tp1), or convert "
        "again without it"
    )


def test_mla_with_fp8_block_scales(tmp_path: Path) -> None:
    target = make_tiny_model(
        tmp_path / "dsv3", "DeepseekV3ForCausalLM", quantization_config=TINY_FP8
    )
    artifact, reference = tmp_path / "tp2", tmp_path / "tp1"
    _convert(target, artifact, 2, 2)
    _convert(target, reference, 1, 2)
    assert set(_compare(artifact, reference, "target")) == {1.0}


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2)])
def test_gpt_oss_fused_experts_transposed_at_a_coarser_tp(tmp_path: Path, tp: int, pp: int) -> None:
    target = make_tiny_model(tmp_path / "gpt-oss", "GptOssForCausalLM")
    artifact, reference = tmp_path / "tp2", tmp_path / "served"
    _convert(target, artifact, 2, 2)
    _convert(target, reference, tp, pp)
    assert set(_compare(artifact, reference, "target")) == {1.0}


@pytest.mark.parametrize(("inter", "served"), [(160, 1), (256, 2), (256, 1)])
def test_unpadded_mxfp4_experts_at_a_coarser_tp(tmp_path: Path, inter: int, served: int) -> None:
    """gpt-oss's MXFP4 experts stored unpadded at tp4 (160: 5 blocks of 32, 2, 2, 1 and
    none a rank; 256: 2 a rank) cut for a coarser tp whose ranks hold the blocks of the
    ranks they are made of: what a conversion made there holds, every byte read once."""
    target = make_tiny_model(
        tmp_path / "gpt-oss", "GptOssForCausalLM", quantization_config=TINY_MXFP4,
        hidden_size=96, intermediate_size=inter, num_hidden_layers=2, num_key_value_heads=4,
        num_local_experts=4,
    )  # fmt: skip
    artifact, reference = tmp_path / "tp4", tmp_path / "served"
    made = _convert(target, artifact, 4, 1)
    assert made.served_tps == ((1, 4) if inter == 160 else (1, 2, 4))
    _convert(target, reference, served, 1)
    assert set(_compare(artifact, reference, "target")) == {1.0}


def test_mxfp4_blocks_split_otherwise_at_a_coarser_tp_are_refused(tmp_path: Path) -> None:
    """5 blocks are 2, 2, 1, 0 a rank at tp4 but 3 and 2 at tp2: tp2's rank 0 would need
    half of tp4's rank 1."""
    target = make_tiny_model(
        tmp_path / "gpt-oss", "GptOssForCausalLM", quantization_config=TINY_MXFP4,
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_key_value_heads=4,
        num_local_experts=4,
    )  # fmt: skip
    artifact = tmp_path / "tp4"
    manifest = _convert(target, artifact, 4, 1)
    assert manifest.served_topologies() == "tp 1, 4 x any pp"
    with pytest.raises(TopologyMismatchError) as info:
        check_served(artifact, manifest, 2, 1)
    assert str(info.value) == (
        f"artifact {artifact} is tp4 x pp1 and serves tp 1, 4 x any pp; vLLM runs tp2 x pp1, "
        "which it cannot serve (vLLM splits its MXFP4 experts' 32-blocks at tp2 across the "
        "artifact's tp4 ranks); start vLLM at a topology it serves, or convert again with "
        "--tp 2 --pp 1"
    )


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("MixtralForCausalLM", {}),
        ("DeepseekV2ForCausalLM", {}),
        ("DeepseekV32ForCausalLM", {"num_nextn_predict_layers": 1}),
        ("DeepseekV4ForCausalLM", {}),  # with its built-in DSpark draft
        ("Glm4MoeForCausalLM", {"num_nextn_predict_layers": 1}),
        ("KimiK25ForConditionalGeneration", {}),
        # the fused in_proj_qkvgfab, its zero rows aligned per rank: 14 at tp2, 12 at tp1
        ("KimiK3ForConditionalGeneration", {"num_nextn_predict_layers": 1}),
        ("KimiK3ForConditionalGeneration", {
            "torch_dtype": "bfloat16", "quantization_config": KIMI_K3_MXFP4,
            "moe_intermediate_size": 256, "routed_expert_hidden_size": 256,
        }),  # MXFP4 experts no backend pads
        ("DeepseekV3ForCausalLM", {  # Kimi-K2-Thinking's int4 experts, with the MTP draft
            "num_hidden_layers": 3, "num_nextn_predict_layers": 1,
            "quantization_config": TINY_INT4,
        }),
        ("Qwen3NextForCausalLM", {}),
        ("Qwen3_5MoeForConditionalGeneration", {}),  # transformers 5's fused expert stacks
        ("Qwen3MoeForCausalLM", {"quantization_config": TINY_NVFP4}),
        ("Qwen3MoeForCausalLM", {"quantization_config": TINY_FP8_CT}),
        ("LlamaForCausalLM", {"quantization_config": TINY_MODELOPT_NVFP4}),
    ],
    ids=["mixtral", "deepseek-v2", "deepseek-v3.2", "deepseek-v4", "glm", "kimi-k2.5",
         "kimi-k3", "kimi-k3-mxfp4", "int4", "qwen3-next", "qwen3.5-moe", "nvfp4", "fp8-ct",
         "modelopt-nvfp4"],
)  # fmt: skip
def test_every_family_and_its_draft_at_tp1_from_tp2(
    tmp_path: Path, architecture: str, overrides: dict
) -> None:
    """An artifact says it serves every tp dividing its own: what it makes for tp1 is, byte
    for byte, what a conversion made at tp1 holds, for the target and its draft."""
    target = make_tiny_model(tmp_path / "model", architecture, **overrides)
    artifact, reference = tmp_path / "tp2-pp2", tmp_path / "tp1"
    made = _convert(target, artifact, 2, 2)
    assert 1 in made.served_tps
    _convert(target, reference, 1, 1)
    for model in made.models:
        assert set(_compare(artifact, reference, model.role)) == {1.0}, model.role


def test_a_tp_that_does_not_divide_is_refused(dense: tuple[Path, Path, Path]) -> None:
    _, _, artifact = dense
    manifest = read_manifest(artifact)
    assert manifest.served_topologies() == "tp 1, 2 x any pp"
    check_served(artifact, manifest, 1, 3)
    with pytest.raises(TopologyMismatchError) as info:
        check_served(artifact, manifest, 4, 1)
    assert str(info.value) == (
        f"artifact {artifact} is tp2 x pp2 and serves tp 1, 2 x any pp; vLLM runs tp4 x pp1, "
        "which it cannot serve (tp4 is not a divisor of the artifact's tp2); start vLLM at a "
        "topology it serves, or convert again with --tp 4 --pp 1"
    )


def test_an_artifact_without_pieces_serves_only_its_own_topology(
    dense: tuple[Path, Path, Path],
) -> None:
    _, _, artifact = dense
    manifest = read_manifest(artifact)
    old = dataclasses.replace(
        manifest,
        models=tuple(dataclasses.replace(m, pieces={}) for m in manifest.models),
        regions=None,
    )
    assert old.served_tps == ()
    with pytest.raises(TopologyMismatchError, match="serves tp2 x pp2 only .made before"):
        check_served(artifact, old, 1, 1)
    one_stage = dataclasses.replace(manifest, stages=(1,))
    assert one_stage.served_topologies() == "tp2 x pp2 only (it holds stage(s) 1)"


def test_zero_rows_counted_for_one_tp_serve_only_that_tp(tmp_path: Path) -> None:
    """Kimi-K3's KDA zero rows as artifacts recorded them before `align_rows`: a count
    for the artifact's tp, which another tp does not pad to."""
    target = make_tiny_model(tmp_path / "k3", "KimiK3ForConditionalGeneration")
    manifest = _convert(target, tmp_path / "tp2", 2, 2)
    assert manifest.served_tps == (1, 2)

    def counted(pieces: tuple) -> tuple:
        return tuple(
            dataclasses.replace(p, cut="zero_rows", heads=14) if p.cut == "align_rows" else p
            for p in pieces
        )

    models = tuple(
        dataclasses.replace(m, pieces={n: counted(p) for n, p in m.pieces.items()})
        for m in manifest.models
    )
    old = dataclasses.replace(manifest, models=models)
    assert old.served_tps == ()
    assert old.served_topologies() == (
        "tp2 x pp2 only (made before shardprep aligned its zero rows for each tp)"
    )


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1)])
def test_deepseek_v3_with_its_mtp_draft(tmp_path: Path, tp: int, pp: int) -> None:
    """The MTP draft, stored on the last stage of tp2 x pp2, cut for the last stage of
    another topology, where it shares the target's embedding (the files leave it out)."""
    target = make_tiny_model(
        tmp_path / "dsv3", "DeepseekV3ForCausalLM", num_hidden_layers=3,
        num_nextn_predict_layers=1,
    )  # fmt: skip
    artifact, reference = tmp_path / "tp2-pp2", tmp_path / "served"
    _convert(target, artifact, 2, 2)
    _convert(target, reference, tp, pp)
    for role in ("target", "draft"):
        assert set(_compare(artifact, reference, role)) == {1.0}
