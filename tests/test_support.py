"""The tests' own support: the canary's checks pass on dumps equal to the rank files and
fail on a changed byte, a missing rank or a missing tensor; and a test module imports
tests/support/, never another test module (what two tests share lives there)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import vllm_env
from artifacts import rank_tensors
from canary import assert_rank_files_equal_dumps, assert_same_state, rank_dumps
from safetensors.torch import save_file

from shardprep.convert.run import Options, convert
from shardprep.format.manifest import read_manifest

TESTS = Path(__file__).resolve().parent
ALIASED = "model.aliased_from_the_target.weight"


@pytest.fixture
def artifact(tiny, tmp_path: Path) -> Path:
    model = tiny.model("support-llama", num_hidden_layers=2)
    draft = tiny.draft("support-eagle3", model, "eagle3")
    options = Options(tp=2, pp=1, draft=str(draft), dtype="float32")
    convert(str(model), tmp_path / "artifact", options, progress=False)
    return tmp_path / "artifact"


def dump_rank_files(artifact: Path, folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    """Each rank's files written as the dump plugin writes vLLM's state, a draft's with
    `extra` (what vLLM would alias from the target) besides."""
    folder.mkdir()
    for entry in {(f.role, f.pp, f.tp) for f in read_manifest(artifact).files}:
        role, pp, tp = entry
        state = rank_tensors(artifact, role, pp, tp) | (extra if role == "draft" else {})
        meta = {"role": json.dumps(role), "trap_armed": json.dumps(True)}
        save_file(state, str(folder / f"{role}-pp{pp}-tp{tp}.safetensors"), metadata=meta)
    return folder


def test_rank_dumps_walks_every_rank_in_order_beside_its_files(
    artifact: Path, tmp_path: Path
) -> None:
    aliased = {ALIASED: torch.zeros(3, 2)}
    dumps = vllm_env.dump_files(dump_rank_files(artifact, tmp_path / "dumps", aliased))
    ranks = list(rank_dumps(dumps, artifact, tp=2, pp=1, draft=True, shared={ALIASED}))
    assert [r.key for r in ranks] == sorted(vllm_env.expected_dumps(2, 1, with_draft=True))
    for rank in ranks:
        assert rank.meta["role"] == rank.role and ALIASED not in rank.state
        assert_same_state(rank.state, rank.ours)
    with pytest.raises(AssertionError):  # the draft's aliased parameter, unless left out
        assert_rank_files_equal_dumps(artifact, dumps)
    assert_rank_files_equal_dumps(artifact, dumps, shared={ALIASED})


def test_the_canary_fails_on_a_changed_byte_a_missing_tensor_or_rank(
    artifact: Path, tmp_path: Path
) -> None:
    dumps = vllm_env.dump_files(dump_rank_files(artifact, tmp_path / "dumps", {}))
    assert_rank_files_equal_dumps(artifact, dumps)
    with pytest.raises(AssertionError):  # the draft's ranks are not the topology's
        list(rank_dumps(dumps, artifact, tp=2, pp=1))
    target = dumps[("target", 0, 1)]
    with pytest.raises(AssertionError):
        list(rank_dumps({("target", 0, 0): dumps[("target", 0, 0)]}, artifact, tp=2, pp=1))
    state = rank_tensors(artifact, "target", 0, 1)
    name = sorted(state)[0]
    changed = state[name].clone()
    changed.view(-1).view(torch.uint8)[0] ^= 1  # one bit of one byte
    save_file(state | {name: changed}, str(target), metadata={"role": '"target"'})
    with pytest.raises(AssertionError, match=name):
        assert_rank_files_equal_dumps(artifact, dumps)
    del state[name]
    save_file(state, str(target), metadata={"role": '"target"'})
    with pytest.raises(AssertionError):
        assert_rank_files_equal_dumps(artifact, dumps)


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_no_test_module_imports_another() -> None:
    tests = sorted(TESTS.rglob("*.py"))
    assert len([p for p in tests if p.name.startswith("test_")]) > 100
    found = {
        f"{path.relative_to(TESTS)} imports {name}"
        for path in tests
        for name in _imported_modules(path)
        if name.split(".")[-1].startswith("test_") or name.startswith("tests.")
    }
    assert sorted(found) == []
