"""One MXFP4 artifact for every MoE kernel backend of vLLM's MXFP4 table, in a real vLLM
(CPU build).

The state before processing depends on the backend: `create_weights` sizes each rank's
expert stacks as `mxfp4_round_up_hidden_size_and_intermediate_size` rounds them for the
chosen backend (Marlin and TRT-LLM: intermediate 128, hidden 256; CUTLASS, DeepGEMM and
FlashInfer CUTLASS: 128 and 128; the CPU and emulation: 32 and 32; Triton, Humming, XPU:
intermediate 64; b12x and the FlashInfer MoE-EP megakernels: none). shardprep stores the
experts unpadded and pads them at load. The test-only plugin replaces the backend choice
alone (`SHARDPREP_MXFP4_BACKENDS`: each MoE layer a process builds takes the next backend
of the list), so one vLLM run builds every backend of the table, one per layer, with vLLM's
own parameters and weight loaders; post-processing, which would need the real kernels, is
set aside, and the state after `load_weights` is the reference.

A tiny gpt-oss with 22 MoE layers (one per backend of vLLM's `Mxfp4MoeBackend`), hidden
size 96 and intermediate size 192 (three 32-blocks a rank at tp2, so that every backend,
the unpadding ones too, can hold them), converted once at tp2 without `--mxfp4-pad`: the
default loader's state holds each layer's stacks in the shape its backend pads to, and
`sharded-fast` on the one artifact leaves the same state, byte for byte, with every
collective refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import STATE_ONLY, TRAP, assert_same_dumps, rank_dumps

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import KIMI_K3_MXFP4, TINY_MXFP4, make_tiny_model
from shardprep.demo.tiny_kimi_k3 import TEXT
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
EXPERTS = "mlp.experts.routed_experts."
H, INTER, E = 96, 192, 4


def backends() -> list[str]:
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    return [b.name for b in Mxfp4MoeBackend if b is not Mxfp4MoeBackend.NONE]


def padded(backend: str, hidden: int, local: int) -> tuple[int, int]:
    """vLLM's own rounding of (hidden, per-rank intermediate) for `backend`."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        mxfp4_round_up_hidden_size_and_intermediate_size,
    )

    return mxfp4_round_up_hidden_size_and_intermediate_size(Mxfp4MoeBackend[backend], hidden, local)


def test_one_gpt_oss_artifact_serves_every_mxfp4_backend_at_tp2(tmp_path: Path) -> None:
    names = backends()
    model = make_tiny_model(
        tmp_path / "model", "GptOssForCausalLM", quantization_config=TINY_MXFP4,
        hidden_size=H, intermediate_size=INTER, num_hidden_layers=len(names),
        num_key_value_heads=4, num_local_experts=E,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    manifest = read_manifest(artifact)
    assert manifest.served_backends().startswith("every kernel backend")
    env = STATE_ONLY | {"SHARDPREP_MXFP4_BACKENDS": ",".join(names)}
    dumps = vllm_env.dump_state(
        model, 2, 1, tmp_path / "default", env=env, dtype="bfloat16", allow_engine_failure=True
    )
    shapes = set()
    for rank in rank_dumps(dumps, tp=2, pp=1):
        state = rank.state
        for layer, backend in enumerate(names):
            hidden, local = padded(backend, H, INTER // 2)
            stack = f"model.layers.{layer}.{EXPERTS}"
            assert tuple(state[stack + "w13_weight"].shape) == (E, 2 * local, hidden // 2)
            assert tuple(state[stack + "w2_weight_scale"].shape) == (E, hidden, local // 32)
            assert tuple(state[stack + "w2_bias"].shape) == (E, hidden)
            shapes.add((hidden, local))
    assert shapes == {(96, 96), (96, 128), (128, 128), (256, 128)}  # each padding of the table
    fast = vllm_env.dump_state(
        artifact, 2, 1, tmp_path / "fast", load_format="dump-sharded-fast",
        env=env | TRAP, dtype="bfloat16", allow_engine_failure=True,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)


KIMI = "KimiK3ForConditionalGeneration"
KIMI_LAYERS = "language_model.model.layers."
# Text only, as the Kimi-K3 tests serve it (tests/vllm/test_vllm_kimi_k3.py).
KIMI_ENGINE = {
    "attention_config": {"backend": "CPU_MLA"},
    "limit_mm_per_prompt": {"image": 0},
    "enable_prefix_caching": False,
}
# One backend of each padding of the table: (intermediate, hidden) 128 and 256, 128 and
# 128, intermediate 64 alone, 32 and 32, none.
KIMI_BACKENDS = ("MARLIN", "CUTLASS_MXFP4_MXFP4", "TRITON", "EMULATION", "B12X_MXFP4_BF16")


def test_one_kimi_k3_artifact_serves_a_backend_of_every_padding_at_tp2(tmp_path: Path) -> None:
    """Kimi-K3's MXFP4 experts (`Mxfp4MoEMethod`, FusedMoE's own loader: gate rows at the
    front of the first half of `w13_*`, up rows at the front of the second) with 96
    intermediate rows a rank and a latent width of 96, which most backends pad: five MoE
    layers, each under a backend of another padding, from one artifact."""
    model = make_tiny_model(
        tmp_path / "model", KIMI, torch_dtype="bfloat16", quantization_config=KIMI_K3_MXFP4,
        moe_intermediate_size=192, routed_expert_hidden_size=96, num_hidden_layers=6,
        linear_attn_config=TEXT["linear_attn_config"] | {
            "full_attn_layers": [2, 4, 6], "kda_layers": [1, 3, 5],
        },
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1), progress=False)
    env = STATE_ONLY | {"VLLM_KIMI_K3_GEMM_AR": "0"}
    env |= {"SHARDPREP_MXFP4_BACKENDS": ",".join(KIMI_BACKENDS)}
    run = {"dtype": "bfloat16", "allow_engine_failure": True, "engine": KIMI_ENGINE}
    dumps = vllm_env.dump_state(model, 2, 1, tmp_path / "default", env=env, **run)
    shapes = set()
    for rank in rank_dumps(dumps, tp=2, pp=1):
        state = rank.state
        for layer, backend in enumerate(KIMI_BACKENDS, start=1):  # layer 0 is dense
            hidden, local = padded(backend, 96, 96)
            stack = f"{KIMI_LAYERS}{layer}.block_sparse_moe.experts.routed_experts."
            w13 = state[stack + "w13_weight"]
            assert tuple(w13.shape) == (8, 2 * local, hidden // 2)
            assert not w13[:, 96:local].any() and not w13[:, local + 96 :].any()
            assert tuple(state[stack + "w2_weight"].shape) == (8, hidden, local // 2)
            shapes.add((hidden, local))
    assert shapes == {(256, 128), (128, 128), (96, 128), (96, 96)}
    fast = vllm_env.dump_state(
        artifact, 2, 1, tmp_path / "fast", load_format="dump-sharded-fast", env=env | TRAP,
        **run,
    )  # fmt: skip
    assert_same_dumps(fast, dumps)
