"""A rerun into a complete artifact keeps its files only when it is the same plan of the
same sources; another model of the same shapes, another dtype or a changed source file
is refused in one line that names what differs, and the artifact stays as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_model
from shardprep.errors import OutputExistsError
from shardprep.format.manifest import read_manifest


@pytest.fixture
def two_models(tmp_path: Path) -> tuple[Path, Path]:
    """Two fine-tunes of one shape: same config, other weights."""
    return make_tiny_model(tmp_path / "a", seed=1), make_tiny_model(tmp_path / "b", seed=2)


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_another_model_of_the_same_shapes_is_refused(two_models, tmp_path: Path) -> None:
    a, b = two_models
    out = tmp_path / "out"
    convert(str(a), out, Options(tp=2, pp=1), progress=False)
    before = snapshot(out)
    with pytest.raises(OutputExistsError) as info:
        convert(str(b), out, Options(tp=2, pp=1), progress=False)
    assert str(info.value) == (
        f"{out} holds a shardprep artifact of another model or topology (target source "
        f"{a.resolve()}); choose a new output folder or delete that one"
    )
    assert snapshot(out) == before and verify(out, full=True).ok


def test_another_dtype_is_refused(two_models, tmp_path: Path, capsys) -> None:
    a, _ = two_models
    out = tmp_path / "out"
    assert main(["convert", str(a), "-o", str(out), "--tp", "2", "--quiet"]) == 0
    capsys.readouterr()
    code = main(["convert", str(a), "-o", str(out), "--tp", "2", "--dtype", "float32", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "(target dtype BF16, not F32)" in err
    assert read_manifest(out).model("target").dtype == "BF16"


def test_a_changed_source_file_is_refused(two_models, tmp_path: Path) -> None:
    a, _ = two_models
    out = tmp_path / "out"
    convert(str(a), out, Options(tp=1, pp=1), progress=False)
    weights = a / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with pytest.raises(OutputExistsError, match="modification time changed"):
        convert(str(a), out, Options(tp=1, pp=1), progress=False)


def test_the_same_plan_is_kept_and_says_so(two_models, tmp_path: Path, capsys) -> None:
    a, _ = two_models
    out = tmp_path / "out"
    args = ["convert", str(a), "-o", str(out), "--tp", "2", "--quiet"]
    assert main(args) == 0
    manifest = read_manifest(out)
    assert manifest.plan_fingerprint is not None
    capsys.readouterr()
    assert main(args) == 0
    assert "already complete: all 2 rank files verified" in capsys.readouterr().out


def test_an_artifact_without_a_fingerprint_is_compared_field_by_field(
    two_models, tmp_path: Path
) -> None:
    a, b = two_models
    out = tmp_path / "out"
    convert(str(a), out, Options(tp=1, pp=1), progress=False)
    path = out / "shardprep.json"
    data = json.loads(path.read_text())
    del data["plan_fingerprint"]
    path.write_text(json.dumps(data))
    with pytest.raises(OutputExistsError, match="target source"):
        convert(str(b), out, Options(tp=1, pp=1), progress=False)
    convert(str(a), out, Options(tp=1, pp=1), progress=False)  # the same: kept
    assert read_manifest(out).plan_fingerprint is not None
    with pytest.raises(OutputExistsError, match="target source"):
        convert(str(b), out, Options(tp=1, pp=1), progress=False)


def test_adding_expert_parallelism_is_named(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "moe", "Qwen3MoeForCausalLM")
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    before = snapshot(out)
    with pytest.raises(OutputExistsError) as info:
        convert(str(model), out, Options(tp=2, pp=1, expert_parallel=True), progress=False)
    assert str(info.value) == (
        f"{out} holds a shardprep artifact of another model or topology (expert parallelism "
        "off, not on); choose a new output folder or delete that one"
    )
    assert snapshot(out) == before
