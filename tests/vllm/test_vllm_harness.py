"""The reference for every real-vLLM test: vLLM's default loader equals Hugging Face
transformers token for token (float32), on a tiny Llama saved by transformers itself; and
a shardprep artifact of that model served through the OpenAI-compatible server with
`--load-format sharded-fast` gives the same tokens.

Tiny random Llama (hidden 128, 4 heads of 32: the CPU attention needs head_dim >= 32).
Each test starts one vLLM (15-60 s).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import transformers
import vllm_env

from shardprep.convert.run import Options, convert

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="no vLLM python found"),
]

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 128, 256, 4, 2, 1000
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
MAX_TOKENS = 8


def make_llama(path: Path, num_layers: int = 4, tie: bool = False) -> Path:
    """A tiny random LlamaForCausalLM checkpoint (safetensors, float32)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hf_tokens(llama: Path) -> list[list[int]]:
    return vllm_env.transformers_greedy(llama, PROMPTS, MAX_TOKENS)


def test_default_loader_tp1_matches_transformers(llama: Path, hf_tokens: list[list[int]]) -> None:
    assert vllm_env.generate(llama, 1, 1, prompts=PROMPTS, max_tokens=MAX_TOKENS) == hf_tokens


def test_server_with_sharded_fast_tp2_matches_transformers(
    llama: Path, hf_tokens: list[list[int]], tmp_path: Path
) -> None:
    """`python -m vllm.entrypoints.openai.api_server --load-format sharded-fast` on
    127.0.0.1, one /v1/completions request, the server stopped by its PID."""
    artifact = tmp_path / "artifact"
    convert(str(llama), artifact, Options(tp=2, pp=1, dtype="float32"), progress=False)
    tokens = vllm_env.serve_and_complete(
        artifact, 2, 1, "sharded-fast", PROMPTS[0], max_tokens=MAX_TOKENS
    )
    assert tokens == hf_tokens[0]


SCAN_AFTER_NUMBA = """
import sys
sys.path.insert(0, sys.argv[1])
from vllm.transformers_utils.processors import kimi_k25_vision_fused  # numba, so llvmlite
from vllm.platforms import cpu
try:
    cpu.CpuPlatform.register_triton_kernel_overrides()
    print("unpatched: passed")
except AttributeError as exc:
    print("unpatched:", exc)
import vllm_runner
vllm_runner.start_workers_by_fork()
cpu.CpuPlatform.register_triton_kernel_overrides()
from llvmlite.binding import ffi
from vllm.triton_utils.dispatcher import KernelOverride
from vllm.v1.worker.block_table import ComputeSlotMappingKernel
print("patched:", isinstance(ComputeSlotMappingKernel.kernel, KernelOverride))
print("library:", callable(ffi.lib.LLVMPY_GetVersionInfo))
"""


def test_the_kernel_override_scan_passes_llvmlite_in_a_forked_worker() -> None:
    """A forked worker inherits the modules its parent imported for a multimodal model's
    processors (numba, so llvmlite); vLLM's kernel-override scan of them fails on
    llvmlite's library object, and passes once the runner's fork set-up is in place: the
    overrides are registered, the library's functions still resolve. (The Kimi-K2.5 test
    runs such forked workers end to end.)"""
    out = subprocess.run(
        [vllm_env.require_python(), "-c", SCAN_AFTER_NUMBA, str(vllm_env.SUPPORT)],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout.splitlines()  # fmt: skip
    assert out == [
        "unpatched: '_lib_fn_wrapper' object has no attribute 'get'",
        "patched: True",
        "library: True",
    ]
