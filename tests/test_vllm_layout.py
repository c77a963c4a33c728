"""The heart of the converter's proof: for every rank, the parameters that vLLM's own
default loader leaves in memory (before processing) equal shardprep's rank files — same
names, shapes, dtypes and bytes, nothing missing, nothing extra."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_env
from safetensors.torch import load_file

from shardprep.convert import Options, convert
from shardprep.manifest import read_manifest
from shardprep.tiny import make_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CASES = {
    # name: (architecture, tp, pp, config overrides, extra environment)
    "llama-tp1-vocab1000": ("LlamaForCausalLM", 1, 1, {}, {}),
    "mistral-tp2": ("MistralForCausalLM", 2, 1, {"vocab_size": 32001}, {}),
    "qwen2-pp2-5layers-tied": (
        "Qwen2ForCausalLM", 1, 2, {"num_hidden_layers": 5, "tie_word_embeddings": True}, {}
    ),
    "qwen3-tp2-pp2": ("Qwen3ForCausalLM", 2, 2, {}, {}),
    "llama-tp2-pp2-kv1-partition": (
        "LlamaForCausalLM", 2, 2,
        {"num_key_value_heads": 1, "num_hidden_layers": 5, "vocab_size": 1000},
        {"VLLM_PP_LAYER_PARTITION": "1,4"},
    ),
}  # fmt: skip


def rank_tensors(artifact: Path, role: str, pp: int, tp: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for entry in read_manifest(artifact).rank_files(role, pp, tp):
        part = load_file(artifact / entry.path)
        assert not set(part) & set(tensors), "a parameter appears in two parts"
        tensors.update(part)
    return tensors


def assert_same_state(vllm_state: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(vllm_state)
    for name, expected in vllm_state.items():
        got = ours[name]
        assert (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape)), name
        assert torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_files_equal_vllm_default_loader_state(case: str, tmp_path: Path) -> None:
    arch, tp, pp, overrides, env = CASES[case]
    model = make_tiny_model(tmp_path / "model", arch, **overrides)
    partition = env.get("VLLM_PP_LAYER_PARTITION")
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=tp, pp=pp, partition=partition), progress=False)
    dumps = vllm_env.dump_state(model, tp, pp, tmp_path / "dump", env=env)
    assert sorted(dumps) == [("target", p, t) for p in range(pp) for t in range(tp)]
    for (role, p, t), path in dumps.items():
        vllm_state, _ = vllm_env.read_dump(path)
        assert_same_state(vllm_state, rank_tensors(artifact, role, p, t))
