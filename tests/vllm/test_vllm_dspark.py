"""DSpark drafts against vLLM's own module, without an engine.

vLLM's CPU build refuses DSpark when it checks the engine config ("Model Runner V1 does
not support: dspark speculative decoding"), before anything is loaded. So one process
(tp1) and two gloo processes (tp2) each set up vLLM's parallel state on the CPU, build
vLLM's `Qwen3DSparkForCausalLM` from an engine config made with that one check skipped,
and load it twice:

- with vLLM's default loader from the source checkpoint (vLLM's `load_weights`): the
  state equals shardprep's rank files of that rank, byte for byte;
- with shardprep's `sharded-fast` loader from the artifact, every collective refused:
  the state equals the first one, and so do the side effects of vLLM's `load_weights`
  (the fused KV buffers, the flags, and `confidence_head = None` when the checkpoint
  has no confidence head although the config enables one).

This file is also the worker: `python tests/vllm/test_vllm_dspark.py --rank R ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
CASES = {
    # name: (tensors the draft checkpoint leaves out, config.json overrides)
    "own-heads": ((), {}),
    "shared-heads-no-confidence": (("embed_tokens.weight", "lm_head.weight", *CONFIDENCE), {}),
    "sink-bias": ((), {"dflash_config": {"attention_sink_bias": True}}),
}
RESULT = "DSPARK-RESULT "


# --- the worker -------------------------------------------------------------------------


def engine_config(target: Path, draft: Path, tp: int):  # type: ignore[no-untyped-def]
    from vllm.config import vllm as vllm_config_module
    from vllm.engine.arg_utils import EngineArgs

    # The only refusal on the CPU build is the V1 runner's list of unsupported features.
    vllm_config_module.VllmConfig._validate_v1_model_runner = lambda self: None
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 4}
    args = EngineArgs(
        model=str(target), dtype="float32", tensor_parallel_size=tp, skip_tokenizer_init=True,
        max_model_len=256, enforce_eager=True, speculative_config=spec,
    )  # fmt: skip
    return args.create_engine_config()


def build_draft(config):  # type: ignore[no-untyped-def]
    import torch
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    config.compilation_config.static_forward_context.clear()  # one draft at a time
    with torch.device("cpu"):
        return Qwen3DSparkForCausalLM(vllm_config=config)


def side_effects(model) -> dict[str, object]:  # type: ignore[no-untyped-def]
    inner = model.model
    return {
        "has_own_embed_tokens": getattr(model, "has_own_embed_tokens", False),
        "has_own_lm_head": getattr(model, "has_own_lm_head", False),
        "confidence_head": inner.confidence_head is not None,
        "fused_kv_layers": getattr(inner, "_num_attn_layers", None),
    }


def run_worker(args: argparse.Namespace) -> int:
    import torch
    from artifacts import rank_tensors
    from canary import assert_same_state
    from shardprep_test_dump.trap import collectives_refused
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader

    from shardprep.loader.plugin import ShardedFastLoader

    root = args.root
    configs = {case: engine_config(root / "target", root / case, args.tp) for case in CASES}
    init_distributed_environment(
        world_size=args.tp, rank=args.rank, local_rank=args.rank, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{args.port}",
    )  # fmt: skip
    with set_current_vllm_config(configs["own-heads"]):
        initialize_model_parallel(args.tp, 1)
    checked = {}
    for case, config in configs.items():
        with set_current_vllm_config(config):
            draft_config = config.speculative_config.draft_model_config
            draft_config.model = str(root / case)
            default = build_draft(config)
            get_model_loader(LoadConfig(load_format="auto")).load_weights(default, draft_config)
            artifact = root / f"{case}-tp{args.tp}"
            draft_config.model = str(artifact / "draft")
            fast = build_draft(config)
            with collectives_refused() as calls:
                ShardedFastLoader(LoadConfig(load_format="sharded-fast")).load_weights(
                    fast, draft_config
                )
            assert calls == [], calls
            state = {n: p.detach() for n, p in default.named_parameters()}
            # Parameters vLLM's load_weights leaves untouched: the unused mask embedding
            # (zeros), and the embedding and lm_head a draft without its own shares.
            untouched = {"model.mask_embedding"}
            if not default.has_own_embed_tokens:
                untouched.add("model.embed_tokens.weight")
            if not default.has_own_lm_head:
                untouched.add("lm_head.weight")
            ours = rank_tensors(artifact, "draft", 0, args.rank)
            assert_same_state({n: t for n, t in state.items() if n not in untouched}, ours)
            # Unloaded shared parameters hold whatever memory they got in both models.
            garbage = untouched - {"model.mask_embedding"}
            fast_state = {n: p.detach() for n, p in fast.named_parameters() if n not in garbage}
            assert_same_state({n: t for n, t in state.items() if n not in garbage}, fast_state)
            assert side_effects(fast) == side_effects(default), case
            assert torch.equal(fast.model._fused_kv_weight, default.model._fused_kv_weight)
            assert torch.equal(fast.model._k_norm_weights, default.model._k_norm_weights)
            sinks = [n for n in state if n.endswith("attention_sink_bias")]
            checked[case] = {"params": len(state), "sinks": sinks, **side_effects(default)}
    print(RESULT + json.dumps({"tp": args.tp, "rank": args.rank, **checked}), flush=True)
    return 0


# --- the test ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.convert.run import Options, convert
    from shardprep.demo.tiny import make_tiny_draft, make_tiny_model

    root = tmp_path_factory.mktemp("dspark")
    target = make_tiny_model(root / "target", "Qwen3ForCausalLM", num_hidden_layers=4)
    for case, (omit, overrides) in CASES.items():
        draft = make_tiny_draft(root / case, target, "dspark", omit=omit, **overrides)
        for tp in (1, 2):
            options = Options(tp=tp, pp=1, draft=str(draft), dtype="float32")
            convert(str(target), root / f"{case}-tp{tp}", options, progress=False)
    return root


@pytest.mark.vllm
@pytest.mark.slow
def test_dspark_rank_files_equal_vllm_module_state_at_tp1_and_tp2(prepared: Path) -> None:
    import vllm_env
    from gloo_workers import Worker, run_workers
    from ports import free_port

    if vllm_env.vllm_python() is None:
        pytest.skip("needs the vLLM environment")
    workers = []
    for tp, ranks in ((1, [0]), (2, [0, 1])):
        port = str(free_port())
        args = ("--root", str(prepared), "--tp", str(tp), "--port", port)
        workers += [Worker(f"tp{tp}-rank{r}", (*args, "--rank", str(r)), f"tp{tp}") for r in ranks]
    results = run_workers(__file__, workers, RESULT, {})
    assert sorted((r["tp"], r["rank"]) for r in results) == [(1, 0), (2, 0), (2, 1)]
    for result in results:
        own, shared = result["own-heads"], result["shared-heads-no-confidence"]
        assert (own["has_own_embed_tokens"], own["has_own_lm_head"], own["confidence_head"]) == (
            True, True, True,
        )  # fmt: skip
        assert (shared["has_own_lm_head"], shared["confidence_head"]) == (False, False)
        assert own["fused_kv_layers"] == shared["fused_kv_layers"] == 1
        assert own["sinks"] == [] and result["sink-bias"]["sinks"] == [
            "model.layers.0.self_attn.attention_sink_bias"
        ]


if __name__ == "__main__":
    # A worker runs this file as a script: the tests' shared modules are not on its path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    sys.exit(run_worker(parser.parse_args()))
