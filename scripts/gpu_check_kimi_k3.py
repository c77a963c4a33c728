"""Kimi-K3 on a GPU machine: the rank files against vLLM's own per-rank state there.

    python scripts/gpu_check_kimi_k3.py [--tp 1] [--pp 1] [--dir DIR]

Run it with a GPU build of vLLM 0.32 (and shardprep installed, so that its `sharded-fast`
loader is registered), from the repository root. It adds `tests/vllm_dump_plugin` and
`tests/support` to the path and makes what the CPU build of the test suite cannot:

- a tiny Kimi-K3 in the published naming with the published activation (`situ`, whose
  MoE the CPU build cannot run), converted at `--tp` x `--pp`;
- vLLM's default loader dumps every rank's state right after `load_weights` on the GPU
  (its GPU MLA, KDA and MoE backends; prefix caching off, `VLLM_KIMI_K3_GEMM_AR=0`);
  each rank file must equal it byte for byte;
- `sharded-fast` with every collective refused while loading dumps the same state, and
  (the GPU build can generate) the greedy tokens of both loaders must be equal.

It prints one line per check and exits 1 at the first difference. It needs tp x pp GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm_dump_plugin"), str(ROOT / "tests" / "support")]

KIMI = "KimiK3ForConditionalGeneration"
ENGINE = {"limit_mm_per_prompt": {"image": 1}, "enable_prefix_caching": False}
ENV = {"VLLM_KIMI_K3_GEMM_AR": "0"}
TRAP = {"SHARDPREP_TRAP_COLLECTIVES": "1"}


def compare(artifact: Path, dumps: dict) -> list[str]:
    """Differences between each rank file and vLLM's dump of that rank."""
    import torch
    import vllm_env
    from safetensors.torch import load_file

    from shardprep.format.manifest import read_manifest

    problems = []
    for (role, pp, tp), path in sorted(dumps.items()):
        state, _ = vllm_env.read_dump(path)
        ours: dict = {}
        for entry in read_manifest(artifact).rank_files(role, pp, tp):
            ours.update(load_file(artifact / entry.path))
        if sorted(ours) != sorted(state):
            missing, extra = sorted(set(state) - set(ours)), sorted(set(ours) - set(state))
            problems.append(f"{role} pp{pp} tp{tp}: missing {missing[:3]}, extra {extra[:3]}")
            continue
        for name, expected in state.items():
            got = ours[name]
            same = (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape))
            raw = expected.contiguous().reshape(-1).view(torch.uint8)
            if not same or not torch.equal(got.reshape(-1).view(torch.uint8), raw):
                problems.append(f"{role} pp{pp} tp{tp}: {name} differs")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dir", default="gpu-check-kimi-k3")
    args = parser.parse_args()

    import vllm_env

    from shardprep.convert.run import Options, convert
    from shardprep.demo.tiny import make_tiny_model

    root = Path(args.dir)
    overrides: dict = {"hidden_act": "situ", "torch_dtype": "bfloat16"}
    model = make_tiny_model(root / "model", KIMI, **overrides)
    if args.tp == 1:  # vLLM's own threshold: nothing to pad at tp 1
        config = (
            (model / "config.json")
            .read_text()
            .replace('"min_moe_intermediate_per_partition": 16, ', "")
        )
        (model / "config.json").write_text(config)
    artifact = root / "artifact"
    convert(str(model), artifact, Options(tp=args.tp, pp=args.pp), progress=False)
    run = {"dtype": "bfloat16", "engine": ENGINE, "max_tokens": 8}
    started = time.perf_counter()
    default = vllm_env.generate(
        model, args.tp, args.pp, "dump-default", dump_dir=root / "default", env=ENV, **run
    )
    print(f"default loader: {time.perf_counter() - started:.0f} s, tokens {default}")
    dumps = vllm_env.dump_files(root / "default")
    problems = compare(artifact, dumps)
    print(f"rank files vs vLLM's state on {len(dumps)} ranks: {problems or 'equal'}")
    started = time.perf_counter()
    fast = vllm_env.generate(
        artifact, args.tp, args.pp, "dump-sharded-fast", dump_dir=root / "fast",
        env=ENV | TRAP, **run,
    )  # fmt: skip
    print(f"sharded-fast: {time.perf_counter() - started:.0f} s, tokens {fast}")
    fast_dumps = vllm_env.dump_files(root / "fast")
    for key, path in fast_dumps.items():
        _, meta = vllm_env.read_dump(path)
        if not meta.get("trap_armed") or meta.get("collective_calls"):
            problems.append(f"{key}: collectives during the load: {meta.get('collective_calls')}")
    problems += compare(artifact, fast_dumps)
    if fast != default:
        problems.append(f"tokens differ: {fast} vs {default}")
    print("OK" if not problems else "FAILED:\n" + "\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
