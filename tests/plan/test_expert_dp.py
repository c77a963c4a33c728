"""Expert parallelism over tp x dp ranks: the experts of each dp rank in files of their own,
the rest stored once per (stage, tp rank). Planned from header dicts, converted from tiny
checkpoints, read back rank by rank; placement checked against vLLM's own arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from schema import SCHEMA

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_model, tiny_config
from shardprep.errors import ManifestError, PlanError, TopologyMismatchError
from shardprep.format.manifest import Manifest, parse_manifest, read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.loader.experts import check_experts
from shardprep.loader.reader import read_rank
from shardprep.plan import archs
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel
from shardprep.plan.topology import experts_of_rank

QWEN3_MOE = "Qwen3MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
W13 = "model.layers.{layer}.mlp.experts.routed_experts.w13_weight"


def source(config: dict[str, Any]) -> SourceModel:
    _, family = archs.target_family(config)
    return SourceModel(config, {n: ("BF16", s) for n, s in family.expected_shapes(config).items()})


def files_of(plan: Plan, tp: int, dp: int | None) -> list[Any]:
    return [f for f in plan.files if (f.pp, f.tp, f.dp) == (0, tp, dp)]


def held(plan: Plan, tp: int, dp: int, name: str) -> tuple[int, ...]:
    """The global experts whose gate rows a dp rank's files stack in `name`, in order."""
    (stack,) = [t for f in files_of(plan, tp, dp) for t in f.tensors if t.name == name]
    gates = [b.source for b in stack.blocks if b.source and "gate_proj" in b.source]
    assert stack.shape[0] == len(gates)
    return tuple(int(g.split(".")[5]) for g in gates)


@pytest.mark.parametrize(
    ("experts", "tp", "dp"),
    [(7, 2, 2), (5, 1, 3), (13, 4, 3), (9, 2, 3), (8, 1, 2), (11, 2, 5)],
)
def test_each_dp_rank_holds_the_experts_of_ep_rank_dp_times_tp_plus_tp(
    experts: int, tp: int, dp: int
) -> None:
    config = tiny_config(QWEN3_MOE, num_experts=experts)
    plan = make_plan(source(config), ConversionRequest(tp=tp, pp=1, expert_parallel=True, dp=dp))
    name = W13.format(layer=0)
    seen: list[int] = []
    for tp_rank in range(tp):
        shared = [t for f in files_of(plan, tp_rank, None) for t in f.tensors]
        assert shared and not any(t.experts for t in shared)  # no expert stack is shared
        for dp_rank in range(dp):
            ids = held(plan, tp_rank, dp_rank, name)
            ep_rank = dp_rank * tp + tp_rank
            assert ids == experts_of_rank(experts, tp * dp, ep_rank, "linear")
            base, extra = divmod(experts, tp * dp)
            assert len(ids) == base + (ep_rank < extra)  # the remainder to the first ranks
            seen += ids
    assert sorted(seen) == list(range(experts))  # every expert on exactly one EP rank
    rank_experts = plan.models[0].experts.rank_experts  # type: ignore[union-attr]
    assert [len(r) for r in rank_experts] == [
        len(experts_of_rank(experts, tp * dp, r, "linear")) for r in range(tp * dp)
    ]


def test_the_shared_files_do_not_grow_with_dp() -> None:
    config = tiny_config(MIXTRAL, num_local_experts=6)
    one = make_plan(source(config), ConversionRequest(tp=2, pp=1, expert_parallel=True))
    three = make_plan(source(config), ConversionRequest(tp=2, pp=1, expert_parallel=True, dp=3))
    rest = {t.name: t for f in files_of(one, 1, None) for t in f.tensors if not t.experts}
    shared = {t.name: t for f in files_of(three, 1, None) for t in f.tensors}
    assert shared == rest
    assert sum(f.nbytes for f in three.files) == sum(f.nbytes for f in one.files)
    assert [f.path for f in files_of(three, 1, 2)] == [
        "shards/model-pp-0-tp-1-dp-2-part-0.safetensors"
    ]


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2), (2, 3), (4, 2), (2, 5), (1, 8)])
def test_placement_is_vllms_determine_expert_map(tp: int, dp: int) -> None:
    """vLLM's own placement function, for the EP rank of every (tp rank, dp rank)."""
    manager = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    config = tiny_config(MIXTRAL, num_local_experts=11)
    plan = make_plan(source(config), ConversionRequest(tp=tp, pp=1, expert_parallel=True, dp=dp))
    name = "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"
    for tp_rank in range(tp):
        for dp_rank in range(dp):
            local, expert_map, _ = manager.determine_expert_map(tp * dp, dp_rank * tp + tp_rank, 11)
            mapping = expert_map.tolist()
            theirs = tuple(
                sorted((e for e in range(11) if mapping[e] >= 0), key=mapping.__getitem__)
            )
            (stack,) = [
                t for f in files_of(plan, tp_rank, dp_rank) for t in f.tensors if t.name == name
            ]
            ours = tuple(int(b.source.split(".")[5]) for b in stack.blocks[::2])
            assert (ours, stack.shape[0]) == (theirs, local)


def test_dp_bad_input_is_one_clear_line() -> None:
    moe = source(tiny_config(MIXTRAL))
    with pytest.raises(PlanError, match="--dp 2 without --enable-expert-parallel cuts every"):
        make_plan(moe, ConversionRequest(tp=2, pp=1, dp=2))
    with pytest.raises(PlanError, match="data parallel size must be at least 1, got --dp 0"):
        make_plan(moe, ConversionRequest(tp=2, pp=1, expert_parallel=True, dp=0))
    with pytest.raises(PlanError, match="over tp x dp = 12 ranks needs at least 12 experts"):
        make_plan(moe, ConversionRequest(tp=2, pp=1, expert_parallel=True, dp=6))
    dense = source(tiny_config())
    with pytest.raises(PlanError) as info:
        make_plan(dense, ConversionRequest(tp=2, pp=1, expert_parallel=True, dp=2))
    assert "--dp 2 matters only to a mixture-of-experts model" in str(info.value)


def test_deepseek_shared_experts_under_sequence_parallel_moe_are_refused() -> None:
    config = tiny_config("DeepseekV3ForCausalLM")
    plan = make_plan(source(config), ConversionRequest(tp=1, pp=1, expert_parallel=True, dp=2))
    assert plan.models[0].experts is not None
    with pytest.raises(PlanError, match="vLLM replicates the shared experts"):
        make_plan(source(config), ConversionRequest(tp=2, pp=1, expert_parallel=True, dp=2))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Qwen3-MoE with 7 experts, layers 0 and 3 dense, at tp2 x pp2 x dp2 (EP 4): stage 1
    holds layers 3 (dense) and 4."""
    root = tmp_path_factory.mktemp("expert-dp")
    model = make_tiny_model(
        root / "model", QWEN3_MOE, num_hidden_layers=5, mlp_only_layers=[0, 3], num_experts=7
    )
    out = root / "out"
    options = Options(tp=2, pp=2, dtype="float32", expert_parallel=True, dp=2)
    convert(str(model), out, options, progress=False)
    return model, out


def test_manifest_records_dp_files_and_matches_the_schema(artifact: tuple[Path, Path]) -> None:
    _, out = artifact
    document = json.loads((out / "shardprep.json").read_text())
    jsonschema.validate(document, SCHEMA)
    manifest = read_manifest(out)
    assert parse_manifest(manifest.to_json()) == manifest
    target = manifest.model("target")
    assert target is not None and target.experts is not None
    assert (target.experts.dp, target.experts.rank_experts) == (2, ((0, 1), (2, 3), (4, 5), (6,)))
    assert manifest.request is not None  # what verify --full below replays
    assert (manifest.request.dp, manifest.request.expert_parallel) == (2, True)
    keys = {f"pp{p}-tp{t}" for p in range(2) for t in range(2)}
    assert set(target.ranks) == keys | {f"{k}-dp{d}" for k in keys for d in range(2)}
    assert target.ranks["pp1-tp1-dp1"].keys() == {
        W13.format(layer=4),
        W13.format(layer=4).replace("w13", "w2"),
    }
    assert target.ranks["pp1-tp1-dp1"][W13.format(layer=4)].shape == (1, 128, 128)
    dp_paths = [f.path for f in manifest.rank_files("target", 1, 1, 1)]
    assert dp_paths == [
        "shards/model-pp-1-tp-1-part-0.safetensors",
        "shards/model-pp-1-tp-1-dp-1-part-0.safetensors",
    ]
    result = verify(out, full=True, progress=False)
    assert result.problems == [] and result.round_trip_tensors > 0


def test_a_dp1_manifest_keeps_its_old_form(tmp_path: Path, artifact: tuple[Path, Path]) -> None:
    model, _ = artifact
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1, expert_parallel=True), progress=False)
    document = json.loads((out / "shardprep.json").read_text())
    assert all("dp" not in f for f in document["files"])
    assert all(k.count("-") == 1 for k in document["models"][0]["ranks"])
    assert read_manifest(out).model("target").experts.dp == 1  # type: ignore[union-attr]


def test_each_worker_reads_its_rank_files_and_its_dp_ranks_experts(
    artifact: tuple[Path, Path],
) -> None:
    _, out = artifact
    manifest = read_manifest(out)
    target = manifest.model("target")
    assert target is not None
    name = W13.format(layer=1)
    for dp_rank in range(2):
        for tp_rank in range(2):
            tensors = dict(read_rank(out, "target", 0, tp_rank, dp_rank=dp_rank))
            assert {n: (tuple(t.shape)) for n, t in tensors.items()} == {
                n: spec.shape for n, spec in target.rank_params(0, tp_rank, dp_rank).items()
            }
            experts = len(target.experts.rank_experts[dp_rank * 2 + tp_rank])  # type: ignore[union-attr]
            assert tensors[name].shape[0] == experts


def test_inspect_shows_the_experts_of_every_ep_rank(
    artifact: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = artifact
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "experts: 7 per MoE layer, expert parallel over tp 2 x dp 2, linear placement" in text
    assert "    ep rank 2 (dp 1, tp 0): 2 experts: 4-5\n" in text
    assert "    ep rank 3 (dp 1, tp 1): 1 expert: 6\n" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("stage"))
    assert header.split() == ["stage", "role", "tp", "dp", "files", "tensors", "size"]
    rows = [line.split()[:4] for line in lines if line.split()[:2] == ["1", "target"]]
    assert rows == [["1", "target", tp, dp] for tp in ("0", "1") for dp in ("all", "0", "1")]


def _manifest_with(out: Path, change: Any) -> Manifest:
    data = json.loads((out / "shardprep.json").read_text())
    change(data)
    return parse_manifest(json.dumps(data))


def test_a_manifest_that_loses_a_dp_rank_is_refused(artifact: tuple[Path, Path]) -> None:
    _, out = artifact

    def drop_file(data: dict[str, Any]) -> None:
        data["files"] = [f for f in data["files"] if f.get("dp") != 1 or f["pp"] != 0]

    with pytest.raises(ManifestError, match="stage 0 tp rank 0 dp rank 1 has no target file"):
        _manifest_with(out, drop_file)

    def drop_key(data: dict[str, Any]) -> None:
        del data["models"][0]["ranks"]["pp1-tp0-dp1"]

    with pytest.raises(ManifestError, match="ranks differ .* at pp1-tp0-dp1"):
        _manifest_with(out, drop_key)

    def single_dp(data: dict[str, Any]) -> None:
        data["models"][0]["experts"]["dp"] = 1

    with pytest.raises(ManifestError, match="ranks differ"):
        _manifest_with(out, single_dp)


def test_a_dp_mismatch_at_load_names_the_convert_flags(artifact: tuple[Path, Path]) -> None:
    from shardprep.loader.experts import RunningExperts

    _, out = artifact
    experts = read_manifest(out).model("target").experts  # type: ignore[union-attr]
    assert experts is not None
    running = RunningExperts(True, True, 4, "linear", 5, (5,))
    hint = "shardprep convert MODEL --tp 2 --pp 2 EP_FLAGS-o NEW"
    with pytest.raises(TopologyMismatchError) as info:
        check_experts(out, experts, running, hint)
    assert str(info.value) == (
        f"artifact {out} holds experts for --data-parallel-size 2 but vLLM runs "
        "--data-parallel-size 4, which changes which experts each rank holds; start vLLM "
        "with --data-parallel-size 2, or re-run `shardprep convert MODEL --tp 2 --pp 2 "
        "--enable-expert-parallel --dp 4 -o NEW`"
    )


def test_expert_stacks_are_the_only_dp_tensors(artifact: tuple[Path, Path]) -> None:
    _, out = artifact
    manifest = read_manifest(out)
    target = manifest.model("target")
    assert target is not None
    for key, params in target.ranks.items():
        stacked = {n for n in params if n.endswith(("w13_weight", "w2_weight"))}
        assert (key.count("-") == 2) == bool(stacked) == (set(params) == stacked)


def test_the_demo_names_the_mixture_of_experts_families() -> None:
    from shardprep.demo.run import run_demo

    data, text = run_demo()
    for family in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM"):
        assert family in data["supported"]["architectures"]
    assert "DeepseekV2ForCausalLM, DeepseekV32ForCausalLM, DeepseekV3ForCausalLM" in text
    assert "(Kimi-K2 is a DeepseekV3ForCausalLM); drafts: dflash, dspark, eagle, eagle3" in text


def test_the_model_card_lists_dp_files_and_serves_with_the_expert_flags(
    artifact: tuple[Path, Path],
) -> None:
    from shardprep.hub.modelcard import model_card

    _, out = artifact
    card = model_card(read_manifest(out), "org/Model-TP2-PP2-DP2")
    assert "- target experts: 7 per MoE layer, expert parallel over tp 2 x dp 2" in card
    assert "| 1 | target | 1 dp 1 | 1 | 2 |" in card
    assert (
        "--pipeline-parallel-size 2 --load-format sharded-fast --enable-expert-parallel "
        "--data-parallel-size 2\n"
    ) in card


def test_a_huge_dp_in_a_damaged_manifest_is_refused_at_once(artifact: tuple[Path, Path]) -> None:
    _, out = artifact

    def huge(data: dict[str, Any]) -> None:
        data["topology"]["tp"] = 2
        data["models"][0]["experts"]["dp"] = 65536

    with pytest.raises(ManifestError, match="ranks differ"):
        _manifest_with(out, huge)
