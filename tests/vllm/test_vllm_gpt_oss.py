"""gpt-oss (`GptOssForCausalLM`, bfloat16) in a real vLLM (CPU build), at tp2 x pp2.

Two vLLM runs, shared by every test here (a module-scoped fixture), both generating
greedily from the same tiny checkpoint in the Hub's naming (fused experts, gate/up
interleaved, attention sinks, biases):

- vLLM's default loader, dumping what it leaves in memory on every rank;
- `sharded-fast` on the converted artifact, with every collective refused while each
  rank loads, dumping the same way.

Every rank file equals the default loader's state byte for byte: `model.embedding`, the
`attn.` names, sinks split by heads, `w13_weight` of interleaved gate/up columns
transposed, `w2_bias` whole on tp rank 0 and zero on rank 1, the embedding, final norm
and lm_head on both stages. `sharded-fast` fills exactly those bytes and gives the
default loader's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import vllm_env
from canary import TRAP, assert_same_state, rank_dumps
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
TP, PP = 2, 2
EXPERTS = "mlp.experts.routed_experts."


@dataclass(frozen=True)
class Runs:
    model: Path
    artifact: Path
    default: vllm_env.DumpFiles
    fast: vllm_env.DumpFiles
    default_tokens: list[list[int]]
    fast_tokens: list[list[int]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("gpt_oss")
    model = make_tiny_model(root / "model", "GptOssForCausalLM")
    artifact = root / "artifact"
    convert(str(model), artifact, Options(tp=TP, pp=PP), progress=False)
    default_tokens = vllm_env.generate(
        model, TP, PP, vllm_env.DUMP_FORMAT, dtype="bfloat16", dump_dir=root / "default"
    )
    fast_tokens = vllm_env.generate(
        artifact, TP, PP, "dump-sharded-fast", dtype="bfloat16", dump_dir=root / "fast",
        env=TRAP,
    )  # fmt: skip
    return Runs(
        model,
        artifact,
        vllm_env.dump_files(root / "default"),
        vllm_env.dump_files(root / "fast"),
        default_tokens,
        fast_tokens,
    )


def test_gpt_oss_rank_files_equal_vllm_default_loader_state(runs: Runs) -> None:
    source = load_file(runs.model / "model.safetensors")
    for rank in rank_dumps(runs.default, runs.artifact, tp=TP, pp=PP):
        (_, p, t), state = rank.key, rank.state
        assert rank.meta["model_class"] == "GptOssForCausalLM"
        layer = 2 * p  # layers 0-1 on stage 0, 2-3 on stage 1
        prefix = f"model.layers.{layer}."
        hub = f"{prefix}mlp.experts."
        w13 = source[f"{hub}gate_up_proj"][:, :, 128 * t : 128 * (t + 1)]  # 2I/tp = 128
        assert torch.equal(state[f"{prefix}{EXPERTS}w13_weight"], w13.transpose(1, 2))
        bias = state[f"{prefix}{EXPERTS}w2_bias"]
        assert bool(bias.any()) == (t == 0)
        sinks = source[f"{prefix}self_attn.sinks"][2 * t : 2 * t + 2]
        assert torch.equal(state[f"{prefix}attn.sinks"], sinks)
        assert {"model.embedding.weight", "model.norm.weight", "lm_head.weight"} <= set(state)
        assert_same_state(state, rank.ours)


def test_gpt_oss_sharded_fast_loads_every_rank_without_a_collective(runs: Runs) -> None:
    for rank in rank_dumps(runs.fast, runs.artifact, tp=TP, pp=PP):
        assert rank.meta["trap_armed"] and rank.meta["collective_calls"] == []
        assert_same_state(rank.state, rank.ours)


def test_gpt_oss_sharded_fast_gives_the_default_loaders_tokens(runs: Runs) -> None:
    assert [len(seq) for seq in runs.default_tokens] == [8, 8]
    assert runs.fast_tokens == runs.default_tokens
