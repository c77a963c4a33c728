"""One artifact, several topologies, in a real vLLM (CPU build): a tp2 x pp2 artifact of
a dense model with an EAGLE3 draft, loaded through `sharded-fast` at tp1 x pp1, tp2 x pp1
and tp1 x pp2 with every collective trapped, leaves on every rank (draft included, on the
new last stage) what vLLM's default loader leaves there, byte for byte, and generates the
default loader's tokens; a MoE artifact likewise at tp1 x pp1. Each run checks several
things: the suite's time matters."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from test_vllm_layout import _FLAGS, assert_same_state, loaded
from test_vllm_moe import TRAP, assert_same_dumps

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
    model = tiny.model("vllm-topo-llama6", num_hidden_layers=6)
    draft = tiny.draft("vllm-topo-eagle3", model, "eagle3", **AUX)
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2, draft=str(draft))
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    for tp, pp in ((1, 1), (2, 1)):
        dump = tmp_path / f"tp{tp}-pp{pp}"
        default = vllm_env.generate(
            model, tp, pp, "dump-default", dump_dir=dump / "default",
            speculative_config=spec | {"model": str(draft)},
        )  # fmt: skip
        fast = vllm_env.generate(
            artifact, tp, pp, "dump-sharded-fast", dump_dir=dump / "fast", env=TRAP,
            speculative_config=spec | {"model": str(artifact / "draft")},
        )  # fmt: skip
        assert fast == default, (tp, pp)
        _assert_same(vllm_env.dump_files(dump / "fast"), vllm_env.dump_files(dump / "default"),
                     shared, tp, pp)  # fmt: skip
    # tp1 x pp2: the engine fails after loading with a draft at pp > 1 on the CPU, so the
    # state right after loading is what is compared.
    dumps = {}
    runs = (("dump-default", model, draft), ("dump-sharded-fast", artifact, artifact / "draft"))
    for fmt, source, draft_dir in runs:
        dumps[fmt] = vllm_env.dump_state(
            source, 1, 2, tmp_path / "tp1-pp2" / fmt, load_format=fmt,
            env=TRAP if source == artifact else None,
            speculative_config=spec | {"model": str(draft_dir)}, allow_engine_failure=True,
        )  # fmt: skip
    _assert_same(dumps["dump-sharded-fast"], dumps["dump-default"], shared, 1, 2)


def _assert_same(
    fast: vllm_env.DumpFiles, default: vllm_env.DumpFiles, shared: set[str], tp: int, pp: int
) -> None:
    assert fast.keys() == default.keys() == vllm_env.expected_dumps(tp, pp, with_draft=True)
    for key, path in fast.items():
        (state, meta), (expected, default_meta) = map(vllm_env.read_dump, (path, default[key]))
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        assert [meta[f] for f in _FLAGS] == [default_meta[f] for f in _FLAGS], key
        assert_same_state(loaded(expected, meta, shared), loaded(state, meta, shared))


def test_moe_at_a_coarser_tp_and_pp(tiny, tmp_path: Path) -> None:
    model = tiny.model(
        "vllm-topo-qwen3-moe", "Qwen3MoeForCausalLM", num_hidden_layers=5, mlp_only_layers=[0, 3]
    )
    artifact = _convert(model, tmp_path / "tp2-pp2", 2, 2)
    default = vllm_env.generate(model, 1, 1, "dump-default", dump_dir=tmp_path / "default")
    default_dumps = vllm_env.dump_files(tmp_path / "default")
    fast = vllm_env.generate(
        artifact, 1, 1, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP
    )
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), default_dumps)
