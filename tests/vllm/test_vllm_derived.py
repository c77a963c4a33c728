"""Architectures no family module names, converted with the layout derived from vLLM's
own model definition (plan/derived), in a real vLLM (CPU build): every rank file equals
the default loader's per-rank state byte for byte, `sharded-fast` with every collective
trapped leaves the same state and generates the default loader's greedy tokens. One
default run and one sharded-fast run serve every check of a case."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import TRAP, assert_rank_files_equal_dumps, assert_same_dumps
from derived_models import PROVEN, make_transformers_model

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest, read_regions

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]

# the cut a case is there to prove, which its artifact must name
PROVES = {"phi3-fused-qkv": "parts_rows", "phi3-fused-gqa-qkv": "qkv_heads"}


def converted(model: Path, artifact: Path, tp: int, pp: int) -> Path:
    convert(str(model), artifact, Options(tp=tp, pp=pp, dtype="float32"), progress=False)
    layout = read_manifest(artifact).vllm_layout
    assert layout.revisions == {"derived": 1}
    assert layout.verified_with == ("0.32.0",)  # derived from the vLLM installed here
    return artifact


@pytest.mark.parametrize("case", sorted(PROVEN))
def test_derived_rank_files_equal_vllm_and_sharded_fast_gives_its_tokens(
    case: str, tmp_path: Path
) -> None:
    architecture, overrides = PROVEN[case]
    model = make_transformers_model(tmp_path / "model", architecture, **overrides)
    artifact = converted(model, tmp_path / "artifact", 2, 2)
    if case in PROVES:
        (target,) = read_regions(artifact, read_manifest(artifact)).models
        assert PROVES[case] in {p.cut for pieces in target.pieces.values() for p in pieces}
    default = vllm_env.generate(model, 2, 2, "dump-default", dump_dir=tmp_path / "default")
    default_dumps = vllm_env.dump_files(tmp_path / "default")
    assert sorted(default_dumps) == [("target", p, t) for p in range(2) for t in range(2)]
    assert_rank_files_equal_dumps(artifact, default_dumps)
    fast = vllm_env.generate(
        artifact, 2, 2, "dump-sharded-fast", dump_dir=tmp_path / "fast", env=TRAP
    )
    assert_same_dumps(vllm_env.dump_files(tmp_path / "fast"), default_dumps)
    assert fast == default
