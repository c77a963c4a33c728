"""One artifact, several topologies, in a real vLLM (CPU build). Every run loads through
`sharded-fast` with every collective trapped, and every rank then holds what vLLM's
default loader leaves there, byte for byte (a default run's dump, or the rank files of a
conversion made straight at that topology, which the layout canaries prove equal to it):

- a tp2 x pp2 artifact of a dense model with an EAGLE3 draft at tp1 x pp1, tp2 x pp1 and
  tp1 x pp2 (the draft on the new last stage), the default loader's tokens; the same
  artifact at tp1 x pp4 (target only), transformers' tokens;
- a tp2 x pp2 Qwen3-MoE artifact at tp1 x pp1, tp2 x pp1, tp1 x pp2 and tp1 x pp4,
  transformers' tokens;
- a tp2 x pp2 DeepSeek-V3 artifact with its MTP draft at tp1 x pp1 (speculating, the
  default loader's tokens), tp1 x pp2 and tp1 x pp4 (state after loading; tp2 x pp1 is in
  test_vllm_mtp).

Thirteen vLLM runs in all, each checking several things: the suite's time matters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from artifacts import rank_tensors
from canary import FLAGS, FLOAT32_MTP, TRAP, assert_same_state, loaded, rank_dumps, without

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]

# Six layers put EAGLE3's auxiliary layers 4, 5, 6 on the last stage at pp2 (see
# test_vllm_layout); at pp2 the CPU engine loads every rank and then fails before serving.
AUX = {"eagle_aux_hidden_state_layer_ids": [4, 5, 6]}


def _convert(model: Path, out: Path, tp: int, pp: int, **options: object) -> Path:
    convert(str(model), out, Options(tp=tp, pp=pp, dtype="float32", **options), progress=False)
    return out


def test_dense_with_eagle3_at_three_other_topologies(tiny, tmp_path: Path) -> None:
    """Four vLLM runs: the default loader at tp1 x pp1, then sharded-fast at three
    topologies. At tp2 x pp1 and tp1 x pp2 the default loader's state is what a conversion
    made straight at that topology holds (the layout canary, test_vllm_layout, proves it),
    so each rank is compared with such a conversion's rank files instead of another run."""
    model = tiny.model("vllm-topo-llama6", num_hidden_layers=6)
    draft = tiny.draft("vllm-topo-eagle3", model, "eagle3", **AUX)
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2, draft=str(draft))
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    default = vllm_env.generate(
        model, 1, 1, "dump-default", dump_dir=tmp_path / "default",
        speculative_config=spec | {"model": str(draft)},
    )  # fmt: skip
    assert default == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)
    fast_spec = spec | {"model": str(artifact / "draft")}
    fast = vllm_env.generate(
        artifact, 1, 1, "dump-sharded-fast", dump_dir=tmp_path / "fast-tp1-pp1", env=TRAP,
        speculative_config=fast_spec,
    )  # fmt: skip
    assert fast == default
    _assert_same(vllm_env.dump_files(tmp_path / "fast-tp1-pp1"),
                 _states(vllm_env.dump_files(tmp_path / "default")), shared, 1, 1)  # fmt: skip
    tp2 = vllm_env.generate(
        artifact, 2, 1, "dump-sharded-fast", dump_dir=tmp_path / "fast-tp2-pp1", env=TRAP,
        speculative_config=fast_spec,
    )  # fmt: skip
    assert tp2 == default
    reference = _convert(model, tmp_path / "ref-tp2-pp1", 2, 1, draft=str(draft))
    _assert_same(vllm_env.dump_files(tmp_path / "fast-tp2-pp1"), _files(reference, 2, 1),
                 shared, 2, 1)  # fmt: skip
    # At pp > 1 with a draft the CPU engine loads every rank, then fails before serving:
    # the state right after loading is what is compared.
    dumps = vllm_env.dump_state(
        artifact, 1, 2, tmp_path / "fast-tp1-pp2", load_format="dump-sharded-fast", env=TRAP,
        speculative_config=fast_spec, allow_engine_failure=True,
    )  # fmt: skip
    reference = _convert(model, tmp_path / "ref-tp1-pp2", 1, 2, draft=str(draft))
    _assert_same(dumps, _files(reference, 1, 2), shared, 1, 2)


State = dict[str, torch.Tensor]


def _states(dumps: vllm_env.DumpFiles) -> dict[tuple[str, int, int], tuple[State, dict | None]]:
    return {key: vllm_env.read_dump(path) for key, path in dumps.items()}


def _files(artifact: Path, tp: int, pp: int) -> dict[tuple[str, int, int], tuple[State, None]]:
    keys = vllm_env.expected_dumps(tp, pp, with_draft=True)
    return {key: (rank_tensors(artifact, *key), None) for key in keys}


def _assert_same(
    fast: vllm_env.DumpFiles,
    expected: dict[tuple[str, int, int], tuple[State, dict | None]],
    shared: set[str],
    tp: int,
    pp: int,
) -> None:
    """Every rank of the sharded-fast run, loaded with every collective trapped, holds
    the expected state (a default loader's dump, or rank files with no flags)."""
    assert fast.keys() == expected.keys()
    for rank in rank_dumps(fast, tp=tp, pp=pp, draft=True):
        meta, (want, want_meta) = rank.meta, expected[rank.key]
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        if want_meta is not None:
            assert [meta[f] for f in FLAGS] == [want_meta[f] for f in FLAGS], rank.key
            want = loaded(want, want_meta, shared)
        assert_same_state(want, loaded(rank.state, meta, shared))


def test_dense_at_tp1_pp4(tiny, tmp_path: Path) -> None:
    """One vLLM run: the tp2 x pp2 artifact (six layers, 3 + 3) at tp1 x pp4 with
    VLLM_PP_LAYER_PARTITION=2,2,1,1, so that stage 1 (layers 2-3) takes layers of both
    artifact stages; no draft, since the CPU engine serves none at pp > 1. Every rank,
    loaded with every collective trapped, holds what a conversion made at that split
    holds; the tokens are transformers' greedy ones."""
    model = tiny.model("vllm-topo-llama6", num_hidden_layers=6)
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2)
    split = {"VLLM_PP_LAYER_PARTITION": "2,2,1,1"}
    tokens = vllm_env.generate(
        artifact, 1, 4, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP | split
    )
    assert tokens == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)
    reference = _convert(model, tmp_path / "tp1-pp4", 1, 4, partition="2,2,1,1")
    assert read_manifest(reference).topology.partition == (2, 2, 1, 1)
    for rank in rank_dumps(vllm_env.dump_files(tmp_path / "fast"), reference, tp=1, pp=4):
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == [], rank.meta
        assert_same_state(rank.ours, rank.state)


# Qwen3-MoE with five layers, layer 3 dense: the tp2 x pp2 artifact splits them 3 + 2, so
# its stage 1 mixes dense and sparse (vLLM refuses a stage without a sparse layer). Each
# served topology is one vLLM run: tp1 x pp1 and tp2 x pp1 take the experts of both
# artifact tp ranks or of one; at tp1 x pp2 with VLLM_PP_LAYER_PARTITION=2,3 stage 1 takes
# a layer of artifact stage 0 and both layers of stage 1; at tp1 x pp4 vLLM's own split
# (1, 1, 2, 1) puts layers 2 (sparse) and 3 (dense) of two artifact stages on stage 2.
MOE_TOPOLOGIES = [(1, 1, None), (2, 1, None), (1, 2, "2,3"), (1, 4, None)]


@pytest.mark.parametrize(
    ("tp", "pp", "partition"),
    MOE_TOPOLOGIES,
    ids=[f"tp{tp}-pp{pp}" for tp, pp, _ in MOE_TOPOLOGIES],
)
def test_moe_at_coarser_topologies(
    tiny, tmp_path: Path, tp: int, pp: int, partition: str | None
) -> None:
    """One vLLM run each: the tp2 x pp2 MoE artifact served at tp x pp generates
    transformers' greedy tokens, and every rank, loaded with every collective trapped,
    holds what a conversion made at that topology and split holds (the canary's proof of
    the default loader's state)."""
    model = tiny.model(
        "vllm-topo-qwen3-moe", "Qwen3MoeForCausalLM", num_hidden_layers=5, mlp_only_layers=[3]
    )
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2)
    split = {"VLLM_PP_LAYER_PARTITION": partition} if partition else {}
    fast = vllm_env.generate(
        artifact, tp, pp, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP | split
    )
    assert fast == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)
    reference = _convert(model, tmp_path / "reference", tp, pp, partition=partition)
    for rank in rank_dumps(vllm_env.dump_files(tmp_path / "fast"), reference, tp=tp, pp=pp):
        meta = rank.meta
        assert meta["trap_armed"] and meta["collectives_trapped"] > 30, meta
        assert meta["collective_calls"] == [], meta
        assert_same_state(rank.ours, rank.state)


# DeepSeek-V3 (MLA with q_lora_rank, layer 0 dense, routed and shared experts) with its
# MTP draft, five layers, tp2 x pp2 artifact (3 + 2 layers, the draft on stage 1).
MTP_LAYERS = 5


def _mtp_model(tiny) -> Path:
    return tiny.model(
        "vllm-topo-deepseek-v3-mtp", "DeepseekV3ForCausalLM",
        num_hidden_layers=MTP_LAYERS, num_nextn_predict_layers=1,
    )  # fmt: skip


def _shared(artifact: Path) -> set[str]:
    return set(read_manifest(artifact).model("draft").shared_with_target)


def test_deepseek_mtp_at_tp1_pp1(tiny, tmp_path: Path) -> None:
    """Two vLLM runs at tp1 x pp1, both speculating with the MTP draft: vLLM's default
    loader on the checkpoint, then sharded-fast on the tp2 x pp2 artifact with every
    collective trapped. The same tokens; every rank, target and draft, holds what the
    default loader left there (but the draft's copies that vLLM replaces with the target's
    after loading, which the artifact leaves out)."""
    model = _mtp_model(tiny)
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2)
    shared = _shared(_convert(model, tmp_path / "tp1-pp1", 1, 1))
    assert shared == {
        "model.embed_tokens.weight",
        f"model.layers.{MTP_LAYERS}.shared_head.head.weight",
    }
    default = vllm_env.generate(
        model, 1, 1, "dump-default", **FLOAT32_MTP,
        dump_dir=tmp_path / "default",
    )  # fmt: skip
    fast = vllm_env.generate(
        artifact, 1, 1, "dump-sharded-fast", **FLOAT32_MTP,
        dump_dir=tmp_path / "fast", env=TRAP,
    )  # fmt: skip
    assert [len(seq) for seq in fast] == [8, 8]
    assert fast == default
    dumps, reference = (
        vllm_env.dump_files(tmp_path / "fast"),
        vllm_env.dump_files(tmp_path / "default"),
    )
    assert dumps.keys() == reference.keys()
    for rank in rank_dumps(dumps, tp=1, pp=1, draft=True, shared=shared):
        want, meta = vllm_env.read_dump(reference[rank.key])[0], rank.meta
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        if rank.role == "draft":
            assert meta["model_class"] == "DeepSeekMTP"
            want = without(want, shared)
        assert_same_state(want, rank.state)


# At pp > 1 with a draft the CPU engine loads every rank, then fails before serving: the
# state right after loading is what is compared. tp1 x pp2 with the split 2 + 3 takes
# stage 1 from both artifact stages; tp1 x pp4 is vLLM's own split (1, 1, 2, 1).
MTP_PIPELINES = [(2, "2,3"), (4, None)]


@pytest.mark.parametrize(("pp", "partition"), MTP_PIPELINES, ids=["tp1-pp2", "tp1-pp4"])
def test_deepseek_mtp_at_tp1_and_more_stages(
    tiny, tmp_path: Path, pp: int, partition: str | None
) -> None:
    """One vLLM run each: the tp2 x pp2 artifact loaded at tp1 x pp with every collective
    trapped; every rank, the draft on the new last stage included, holds what a conversion
    made at that topology and split holds (the MTP canary, test_vllm_mtp, proves such
    files equal the default loader's state at pp > 1)."""
    model = _mtp_model(tiny)
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2)
    reference = _convert(model, tmp_path / "reference", 1, pp, partition=partition)
    shared = _shared(reference)
    split = {"VLLM_PP_LAYER_PARTITION": partition} if partition else {}
    dumps = vllm_env.dump_state(
        artifact, 1, pp, tmp_path / "fast", load_format="dump-sharded-fast", env=TRAP | split,
        allow_engine_failure=True, **FLOAT32_MTP,
    )  # fmt: skip
    for rank in rank_dumps(dumps, reference, tp=1, pp=pp, draft=True):
        state, meta = rank.state, rank.meta
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        if rank.role == "draft":
            assert meta["model_class"] == "DeepSeekMTP"
            assert (
                "model.embed_tokens.weight" in state and "model.embed_tokens.weight" not in shared
            )
            state = without(state, shared)
        assert_same_state(rank.ours, state)
