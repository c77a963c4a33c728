"""One artifact, several topologies, in a real vLLM (CPU build): a tp2 x pp2 artifact of
a dense model with an EAGLE3 draft, loaded through `sharded-fast` at tp1 x pp1, tp2 x pp1
and tp1 x pp2 with every collective trapped, leaves on every rank (draft included, on the
new last stage) what vLLM's default loader leaves there, byte for byte, and generates the
default loader's tokens; the same artifact at tp1 x pp4 (target only); a MoE artifact
likewise at tp1 x pp1. Six vLLM runs in all, each checking several things: the suite's
time matters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from test_vllm_layout import _FLAGS, assert_same_state, loaded, rank_tensors
from test_vllm_moe import TRAP

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
    assert fast.keys() == expected.keys() == vllm_env.expected_dumps(tp, pp, with_draft=True)
    for key, path in fast.items():
        (state, meta), (want, want_meta) = vllm_env.read_dump(path), expected[key]
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        if want_meta is not None:
            assert [meta[f] for f in _FLAGS] == [want_meta[f] for f in _FLAGS], key
            want = loaded(want, want_meta, shared)
        assert_same_state(want, loaded(state, meta, shared))


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
    dumps = vllm_env.dump_files(tmp_path / "fast")
    assert dumps.keys() == vllm_env.expected_dumps(1, 4, with_draft=False)
    for key, path in dumps.items():
        state, meta = vllm_env.read_dump(path)
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        assert_same_state(rank_tensors(reference, *key), state)


def test_moe_at_a_coarser_tp_and_pp(tiny, tmp_path: Path) -> None:
    """One vLLM run: a tp2 x pp2 MoE artifact at tp1 x pp1, against a conversion made
    at tp1 x pp1 (the canary's proof of the default loader's state) and transformers."""
    model = tiny.model(
        "vllm-topo-qwen3-moe", "Qwen3MoeForCausalLM", num_hidden_layers=5, mlp_only_layers=[0, 3]
    )
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2)
    fast = vllm_env.generate(
        artifact, 1, 1, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP
    )
    assert fast == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)
    reference = _convert(model, tmp_path / "tp1-pp1", 1, 1)
    ((key, path),) = vllm_env.dump_files(tmp_path / "fast").items()
    state, meta = vllm_env.read_dump(path)
    assert meta["trap_armed"] and meta["collectives_trapped"] > 30 and not meta["collective_calls"]
    assert_same_state(rank_tensors(reference, *key), state)
