"""Mixture-of-experts families in a real vLLM (CPU build): every rank file equals what the
default loader leaves on that rank, byte for byte; `sharded-fast` generates the default
loader's greedy tokens with every collective trapped during the load; expert parallelism
is proven on the state right after loading (the CPU MoE kernel then crashes under EP);
EP settings that differ at load fail with one line. Each vLLM run serves several checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import TRAP, assert_rank_files_equal_dumps, assert_same_dumps

from shardprep.convert.run import Options, convert

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]

# Five layers, 0 and 3 dense: at pp2 (3 + 2 layers) each stage mixes dense and sparse.
QWEN3_MOE = ("Qwen3MoeForCausalLM", {"num_hidden_layers": 5, "mlp_only_layers": [0, 3]})
MIXTRAL = ("MixtralForCausalLM", {})
EP = {"enable_expert_parallel": True}


def convert_to(model: Path, out: Path, tp: int, pp: int, **options: object) -> Path:
    convert(str(model), out, Options(tp=tp, pp=pp, dtype="float32", **options), progress=False)
    return out


@pytest.mark.parametrize(
    ("family", "tp", "pp"),
    [(QWEN3_MOE, 2, 2), (MIXTRAL, 2, 2)],
    ids=["qwen3-moe-tp2-pp2", "mixtral-tp2-pp2"],
)
def test_sharded_fast_equals_the_default_loader(
    tiny, tmp_path: Path, family: tuple[str, dict], tp: int, pp: int
) -> None:
    arch, config = family
    model = tiny.model(f"vllm-{arch}", arch, **config)
    artifact = convert_to(model, tmp_path / "artifact", tp, pp)
    default = vllm_env.generate(model, tp, pp, "dump-default", dump_dir=tmp_path / "default")
    default_dumps = vllm_env.dump_files(tmp_path / "default")
    assert sorted(default_dumps) == [("target", p, t) for p in range(pp) for t in range(tp)]
    assert_rank_files_equal_dumps(artifact, default_dumps)
    fast = vllm_env.generate(
        artifact, tp, pp, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP
    )
    assert fast == default
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), default_dumps)


def test_expert_parallel_rank_files_and_load(tiny, tmp_path: Path) -> None:
    """Seven experts over EP 2 (remainder to rank 0: experts 0-3 and 4-6)."""
    arch, config = QWEN3_MOE
    model = tiny.model("vllm-qwen3-moe-7", arch, **config, num_experts=7)
    artifact = convert_to(model, tmp_path / "artifact", 2, 1, expert_parallel=True)
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "default", engine=EP, allow_engine_failure=True
    )
    assert sorted(dumps) == [("target", 0, 0), ("target", 0, 1)]
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert [tuple(vllm_env.read_dump(dumps[k])[0][w13].shape) for k in sorted(dumps)] == [
        (4, 128, 128),
        (3, 128, 128),
    ]
    assert_rank_files_equal_dumps(artifact, dumps)
    fast = vllm_env.dump_state(
        artifact, 2, 1, tmp_path / "fast", engine=EP, allow_engine_failure=True,
        load_format="dump-sharded-fast", env=TRAP,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)


def test_expert_parallel_mismatch_fails_with_one_line(tiny, tmp_path: Path) -> None:
    arch, config = QWEN3_MOE
    model = tiny.model("vllm-qwen3-moe-7", arch, **config, num_experts=7)
    artifact = convert_to(model, tmp_path / "artifact", 2, 1, expert_parallel=True)
    with pytest.raises(vllm_env.VllmRunError) as info:
        vllm_env.generate(artifact, 2, 1, "sharded-fast", timeout=300)
    assert (
        f"TopologyMismatchError: artifact {artifact} holds experts with expert parallelism on "
        "but vLLM runs with it off (--enable-expert-parallel not given); start vLLM with "
        f"--enable-expert-parallel, or re-run `shardprep convert {model} --tp 2 --pp 1 -o NEW`"
    ) in str(info.value)
