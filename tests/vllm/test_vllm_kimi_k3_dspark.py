"""Kimi-K3's DSpark draft (`K3DSparkModel`) and MTP draft (`KimiK3MTPModel`) against
vLLM's own modules, without an engine.

vLLM's CPU build refuses the DSpark method when it checks the engine config ("Model
Runner V1 does not support: dspark speculative decoding"), before anything is loaded.
Its `K3DSparkForCausalLM` builds on the CPU as it is, with no stand-in (its MLA takes the
CPU_MLA backend; no kernel is chosen before the first forward), and so does the target
once vLLM's CPU worker module has put its placeholders for CUDA streams in place. So two
gloo processes set up vLLM's parallel state, make the engine config with that one check
skipped, and build vLLM's modules from a tiny bfloat16 Kimi-K3 and its draft in the
published naming:

- the target at tp1 x pp2 with the draft configured: vLLM's default loader fills each
  stage, and the last stage holds the embedding too (`spec_decode_needs_target_embed`,
  for the draft to alias); every stage's state equals the target's rank files of the
  tp1 x pp2 artifact, byte for byte;
- the draft at tp2 (vLLM builds it with pp = 1, on the last stage; 250 tokens, so that
  `markov_w2` is padded to 256 rows): vLLM's default
  loader (its `load_weights`, with `_duplicate_context_kv_weights` and the mapper that
  drops the embedding) leaves on each rank exactly the draft's rank files of the
  tp2 x pp1 artifact, and of the last stage of the tp2 x pp2 artifact, byte for byte;
- `sharded-fast` with every collective refused loads the same state into both;
- the MTP draft of the same tiny Kimi-K3 with one MTP layer (layer 4: MLA with experts;
  and in a second model KDA with a dense MLP, tp2 x pp1 only) at tp2, method `mtp`:
  vLLM's `KimiK3MTP.load_weights` leaves on each rank exactly the draft's rank files of
  the tp2 x pp1 artifact plus the head and embedding copies it loaded, which equal the
  target's rank files (vLLM's proposer swaps the target's in at pp = 1, so the files
  leave them out); the last stage of the tp2 x pp2 artifact holds the same and the
  embedding too; `sharded-fast` with every collective refused loads the same state.

No tokens: the CPU build has no DSpark drafter to run, nor a Kimi-K3 generation. This
file is also the worker: `python tests/vllm/test_vllm_kimi_k3_dspark.py --rank R ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

KIMI = "KimiK3ForConditionalGeneration"
RESULT = "K3-DSPARK-RESULT "
EMBED = "language_model.model.embed_tokens.weight"
MTP_HEAD = "model.layers.4.shared_head.head.weight"
# Tiny Kimi-K3s with one MTP layer (layer 4): as the tiny config makes it (MLA, experts),
# and KDA (1-based index 5 in kda_layers) with a dense MLP (4 % 3 != 0).
MTP_MODELS: dict[str, dict] = {
    "mtp": {},
    "mtp-kda": {
        "moe_layer_freq": 3,
        "linear_attn_config": {
            "full_attn_layers": [2, 4], "kda_layers": [1, 3, 5], "gate_lower_bound": -5.0,
            "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
    },
}  # fmt: skip


# --- the worker -------------------------------------------------------------------------


def engine_config(target: Path, draft: Path | None, tp: int, pp: int):  # type: ignore[no-untyped-def]
    from vllm.config import vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    # The only refusal on the CPU build is the V1 runner's list of unsupported features.
    vllm_config_module.VllmConfig._validate_v1_model_runner = lambda self: None
    spec: dict = {"method": "mtp", "num_speculative_tokens": 1}  # the target's MTP layers
    if draft is not None:
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    args = EngineArgs(
        model=str(target), dtype="bfloat16", tensor_parallel_size=tp,
        pipeline_parallel_size=pp, skip_tokenizer_init=True, max_model_len=256,
        enforce_eager=True, speculative_config=spec, enable_prefix_caching=False,
        attention_config={"backend": "CPU_MLA"}, limit_mm_per_prompt={"image": 1},
    )  # fmt: skip
    return args.create_engine_config()


def build(cls, config):  # type: ignore[no-untyped-def]
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype

    config.compilation_config.static_forward_context.clear()  # one model at a time
    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return cls(vllm_config=config)


def load_both(cls, config, model_config, source: Path, artifact: Path):  # type: ignore[no-untyped-def]
    """The module loaded by vLLM's default loader from `source`, and by `sharded-fast`
    from `artifact` with every collective refused."""
    from shardprep_test_dump.trap import collectives_refused
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from shardprep.loader.plugin import ShardedFastLoader

    model_config.model = str(source)
    default = build(cls, config)
    get_model_loader(LoadConfig(load_format="auto")).load_weights(default, model_config)
    model_config.model = str(artifact)
    fast = build(cls, config)
    with collectives_refused() as calls:
        ShardedFastLoader(LoadConfig(load_format="sharded-fast")).load_weights(fast, model_config)
    assert calls == [], calls
    return default, fast


def state(model) -> dict:  # type: ignore[no-untyped-def]
    return {n: p.detach() for n, p in model.named_parameters()}


def run_worker(args: argparse.Namespace) -> int:
    # vLLM's CPU worker imports this first: it stands in CPU placeholders for CUDA
    # streams and events (the Kimi-K3 model makes a stream when it is built).
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from artifacts import rank_tensors
    from canary import assert_same_state
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    root, rank = args.root, args.rank
    init_distributed_environment(
        world_size=2, rank=rank, local_rank=rank, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{args.port}",
    )  # fmt: skip
    found: dict[str, object] = {"rank": rank}
    # The target at tp1 x pp2: rank r is stage r.
    config = engine_config(root / "target", root / "draft", 1, 2)
    with set_current_vllm_config(config):
        initialize_model_parallel(1, 2)
        target = KimiK3ForConditionalGeneration
        default, fast = load_both(
            target, config, config.model_config, root / "target", root / "tp1-pp2"
        )
        ours = rank_tensors(root / "tp1-pp2", "target", rank, 0)
        assert_same_state(state(default), ours)
        assert_same_state(state(fast), ours)
        found["target_embed"] = EMBED in ours
        found["target_params"] = len(ours)
    destroy_model_parallel()
    # The draft at tp2 (vLLM builds it with pp = 1 whatever the target's pp).
    config = engine_config(root / "target", root / "draft", 2, 1)
    with set_current_vllm_config(config):
        initialize_model_parallel(2, 1)
        draft_config = config.speculative_config.draft_model_config
        default, fast = load_both(
            K3DSparkForCausalLM, config, draft_config, root / "draft", root / "tp2-pp1" / "draft"
        )
        ours = rank_tensors(root / "tp2-pp1", "draft", 0, rank)
        assert_same_state(state(default), ours)
        assert_same_state(state(fast), ours)
        assert_same_state(ours, rank_tensors(root / "tp2-pp2", "draft", 1, rank))
        assert default.model.embed_tokens is None and default.lm_head is None
        found["draft_params"] = sorted(state(default))
        found["markov_w2"] = list(default.model.markov_head.markov_w2.weight.shape)
    destroy_model_parallel()
    found |= mtp_phase(root, rank)
    print(RESULT + json.dumps(found), flush=True)
    return 0


def mtp_phase(root: Path, rank: int) -> dict[str, object]:
    """The MTP draft (`KimiK3MTP`) of each target with an MTP layer, at tp2 (vLLM builds it
    unsplit by pp, on the last stage)."""
    found: dict[str, object] = {}
    for name in MTP_MODELS:
        found[name] = mtp_draft(root, name, rank)
    return found


def mtp_draft(root: Path, name: str, rank: int) -> list[str]:
    from artifacts import rank_tensors
    from canary import assert_same_state, without
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_model_parallel, initialize_model_parallel
    from vllm.models.kimi_k3.nvidia.mtp import KimiK3MTP

    config = engine_config(root / name, None, 2, 1)
    with set_current_vllm_config(config):
        initialize_model_parallel(2, 1)
        draft_config = config.speculative_config.draft_model_config
        artifact = root / f"{name}-tp2-pp1"
        default, fast = load_both(KimiK3MTP, config, draft_config, root / name, artifact)
        ours = rank_tensors(artifact, "draft", 0, rank)
        # At pp = 1 vLLM's proposer swaps in the target's lm_head and embedding after
        # loading: the files leave them out, and vLLM loaded the same bytes as the
        # target's rank files hold.
        shared = {MTP_HEAD, "model.embed_tokens.weight"}
        assert_same_state(without(state(default), shared), ours)
        assert_same_state(without(state(fast), shared), ours)
        target = rank_tensors(artifact, "target", 0, rank)
        assert torch_equal(state(default)[MTP_HEAD], target["language_model.lm_head.weight"])
        assert torch_equal(state(default)["model.embed_tokens.weight"], target[EMBED])
        # At pp = 2 the draft, on the last stage, holds its own embedding.
        pp2 = root / f"{name}-tp2-pp2"
        if pp2.exists():
            last = rank_tensors(pp2, "draft", 1, rank)
            assert_same_state(without(state(default), {MTP_HEAD}), last)
    destroy_model_parallel()
    return sorted(ours)


def torch_equal(a, b) -> bool:  # type: ignore[no-untyped-def]
    import torch

    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


# --- the test ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.convert.run import Options, convert
    from shardprep.demo.tiny import make_tiny_draft, make_tiny_model

    root = tmp_path_factory.mktemp("k3-dspark")
    # 250 tokens: the embedding and markov_w2 padded to 256 rows.
    target = make_tiny_model(root / "target", KIMI, torch_dtype="bfloat16", vocab_size=250)
    draft = make_tiny_draft(root / "draft", target, "dspark")
    for tp, pp in ((1, 2), (2, 1), (2, 2)):
        options = Options(tp=tp, pp=pp, draft=str(draft), draft_method="dspark")
        convert(str(target), root / f"tp{tp}-pp{pp}", options, progress=False)
    # The same with one MTP layer in the checkpoint's naming: layer 4, MLA with experts
    # (also at tp2 x pp2), or KDA with a dense MLP.
    for name, overrides in MTP_MODELS.items():
        mtp = make_tiny_model(
            root / name, KIMI, torch_dtype="bfloat16", vocab_size=250,
            num_nextn_predict_layers=1, **overrides,
        )  # fmt: skip
        for pp in (1, 2) if name == "mtp" else (1,):
            convert(str(mtp), root / f"{name}-tp2-pp{pp}", Options(tp=2, pp=pp), progress=False)
    return root


@pytest.mark.vllm
@pytest.mark.slow
def test_k3_dspark_rank_files_equal_vllm_module_state(prepared: Path) -> None:
    import vllm_env
    from gloo_workers import Worker, run_workers
    from ports import free_port

    if vllm_env.vllm_python() is None:
        pytest.skip("needs the vLLM environment")
    port = str(free_port())
    workers = [
        Worker(f"rank{rank}", ("--root", str(prepared), "--rank", str(rank), "--port", port), "")
        for rank in (0, 1)
    ]
    results = run_workers(__file__, workers, RESULT, {"VLLM_KIMI_K3_GEMM_AR": "0"})
    by_rank = {r["rank"]: r for r in results}
    assert sorted(by_rank) == [0, 1]
    # The embedding on both stages: the first as always, the last for the draft.
    assert by_rank[0]["target_embed"] and by_rank[1]["target_embed"]
    params = by_rank[0]["draft_params"]
    assert params == by_rank[1]["draft_params"]
    assert "model.context_kv_proj.weight" in params
    assert by_rank[0]["markov_w2"] == by_rank[1]["markov_w2"] == [256, 16]
    assert not any("embed_tokens" in n or "lm_head" in n for n in params)
    for name in MTP_MODELS:
        assert by_rank[0][name] == by_rank[1][name]
        assert "model.layers.4.eh_proj.weight" in by_rank[0][name]
    block = "model.layers.4.mtp_block."
    assert block + "self_attn.fused_qkv_a_g_proj.weight" in by_rank[0]["mtp"]
    assert block + "block_sparse_moe.experts.routed_experts.w13_weight" in by_rank[0]["mtp"]
    assert block + "self_attn.in_proj_qkvgfab.weight" in by_rank[0]["mtp-kda"]
    assert block + "mlp.gate_up_proj.weight" in by_rank[0]["mtp-kda"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    return run_worker(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
