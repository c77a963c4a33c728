"""Kimi-K3 (and its DSpark draft) on a GPU machine: the rank files against vLLM's own
per-rank state there.

    python scripts/gpu_check_kimi_k3.py [--tp 1] [--pp 1] [--draft] [--dir DIR]

Run it with a GPU build of vLLM 0.32 (and shardprep installed, so that its `sharded-fast`
loader is registered), from the repository root. It adds `tests/vllm_dump_plugin` and
`tests/support` to the path and makes what the CPU build of the test suite cannot:

- a tiny Kimi-K3 in the published naming with the published activation (`situ`, whose
  MoE the CPU build cannot run), converted at `--tp` x `--pp`; with `--draft`, a tiny
  DSpark draft in the published naming (`K3DSparkModel`, `make_tiny_draft(..., "dspark")`)
  converted with it and served with `{"method": "dspark", "model": ...,
  "num_speculative_tokens": 3}` (the case reported: tp8 x pp2 with the draft on the last
  stage, here at any tp x pp the machine has GPUs for);
- vLLM's default loader dumps every rank's state right after `load_weights` on the GPU
  (its GPU MLA, KDA and MoE backends; prefix caching off, `VLLM_KIMI_K3_GEMM_AR=0`), the
  draft's on the last stage too; each rank file must equal it byte for byte (the draft's
  embedding and lm_head, which vLLM aliases from the target, left out);
- `sharded-fast` with every collective refused while loading dumps the same state, and
  (the GPU build can generate) the greedy tokens of both loaders must be equal.

It prints one line per check and exits 1 at the first difference. It needs tp x pp GPUs.
Not run yet: no GPU machine was at hand when it was written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm_dump_plugin"), str(ROOT / "tests" / "support")]

KIMI = "KimiK3ForConditionalGeneration"
ENGINE = {"limit_mm_per_prompt": {"image": 1}, "enable_prefix_caching": False}
ENV = {"VLLM_KIMI_K3_GEMM_AR": "0"}
TRAP = {"SHARDPREP_TRAP_COLLECTIVES": "1"}


def speculative(draft: Path | None) -> dict | None:
    """vLLM's speculative config for the DSpark draft in `draft` (None: no draft)."""
    if draft is None:
        return None
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}


def prepare(root: Path, tp: int, pp: int, draft: bool) -> tuple[Path, Path | None, Path]:
    """The tiny Kimi-K3 (and its DSpark draft) and their artifact at tp x pp."""
    from shardprep.convert.run import Options, convert
    from shardprep.demo.tiny import make_tiny_draft, make_tiny_model

    overrides: dict = {"hidden_act": "situ", "torch_dtype": "bfloat16"}
    model = make_tiny_model(root / "model", KIMI, **overrides)
    if tp == 1:  # vLLM's own threshold (256): nothing to pad at tp 1
        config = json.loads((model / "config.json").read_text())
        del config["text_config"]["min_moe_intermediate_per_partition"]
        (model / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    folder = make_tiny_draft(root / "draft", model, "dspark") if draft else None
    artifact = root / "artifact"
    options = Options(tp=tp, pp=pp, draft=str(folder) if folder else None)
    convert(str(model), artifact, options, progress=False)
    return model, folder, artifact


def compare(artifact: Path, dumps: dict) -> list[str]:
    """Differences between each rank file and vLLM's dump of that rank (a draft's
    parameters shared with the target, which vLLM aliases after loading, left out)."""
    import torch
    import vllm_env
    from safetensors.torch import load_file

    from shardprep.format.manifest import read_manifest

    problems = []
    manifest = read_manifest(artifact)
    for (role, pp, tp), path in sorted(dumps.items()):
        state, _ = vllm_env.read_dump(path)
        entry = manifest.model(role)
        shared = set(entry.shared_with_target) if entry is not None else set()
        state = {name: tensor for name, tensor in state.items() if name not in shared}
        ours: dict = {}
        for part in manifest.rank_files(role, pp, tp):
            ours.update(load_file(artifact / part.path))
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
    parser.add_argument("--draft", action="store_true", help="with its DSpark draft")
    parser.add_argument("--dir", default="gpu-check-kimi-k3")
    args = parser.parse_args()

    import vllm_env

    root = Path(args.dir)
    model, draft, artifact = prepare(root, args.tp, args.pp, args.draft)
    run = {"dtype": "bfloat16", "engine": ENGINE, "max_tokens": 8}
    started = time.perf_counter()
    default = vllm_env.generate(
        model, args.tp, args.pp, "dump-default", dump_dir=root / "default", env=ENV,
        speculative_config=speculative(draft), **run,
    )  # fmt: skip
    print(f"default loader: {time.perf_counter() - started:.0f} s, tokens {default}")
    dumps = vllm_env.dump_files(root / "default")
    expected = vllm_env.expected_dumps(args.tp, args.pp, with_draft=args.draft)
    problems = [] if set(dumps) == expected else [f"dumps {sorted(dumps)}, not {expected}"]
    problems += compare(artifact, dumps)
    print(f"rank files vs vLLM's state on {len(dumps)} ranks: {problems or 'equal'}")
    started = time.perf_counter()
    fast = vllm_env.generate(
        artifact, args.tp, args.pp, "dump-sharded-fast", dump_dir=root / "fast",
        env=ENV | TRAP, speculative_config=speculative(artifact / "draft" if draft else None),
        **run,
    )  # fmt: skip
    print(f"sharded-fast: {time.perf_counter() - started:.0f} s, tokens {fast}")
    fast_dumps = vllm_env.dump_files(root / "fast")
    if set(fast_dumps) != expected:
        problems.append(f"sharded-fast dumps {sorted(fast_dumps)}, not {expected}")
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
