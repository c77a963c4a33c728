"""Check Qwen3.5-MoE's rank files against a real vLLM where its model class imports.

vLLM 0.32's `qwen3_5.py` imports `qwen3_vl.py`, which imports transformers'
`image_processing_qwen2_vl`, which imports torchvision at module level: the model cannot be
built where torchvision does not import (the CPU build here). Run this where it does (a GPU
machine with vLLM, torchvision and the test harness's environment: `SHARDPREP_VLLM_PYTHON`,
`PYTHONPATH` holding the repository and `tests/vllm_dump_plugin`):

    python scripts/check_qwen3_5_moe.py --tp 1 --pp 1 --dir /tmp/q35   # one GPU
    python scripts/check_qwen3_5_moe.py --tp 2 --pp 2 --dir /tmp/q35   # four GPUs

It makes a tiny `Qwen3_5MoeForConditionalGeneration` checkpoint as published (two layers,
text and vision tower, one MTP layer), converts it, dumps every rank's state after vLLM's
default loader (`load_weights`, before `process_weights_after_loading`) with the MTP draft,
and compares it byte for byte with the rank files; then (pp = 1) generates with the MTP
draft speculating through the default loader and through `sharded-fast` with every
collective trapped, and compares the tokens. `--plan` instead plans the published
Qwen3.6-35B-A3B config at tp8 x pp2, tp8 x pp4 and tp16 and prints the time of each.
Exit status 0 when everything matches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support"), str(ROOT / "tests" / "vllm")]

ARCH = "Qwen3_5MoeForConditionalGeneration"
MTP = {"method": "mtp", "num_speculative_tokens": 1}
SHARED = {"lm_head.weight", "model.embed_tokens.weight"}


def plan_published() -> int:
    from shardprep.plan import archs
    from shardprep.plan.make import make_plan
    from shardprep.plan.records import SourceModel

    config = json.loads((ROOT / "tests/data/qwen3.6-35b-a3b/config.json").read_text())
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    draft = archs.draft_family("mtp", family.name)
    shapes = family.expected_shapes(read) | draft.expected_shapes(read)
    source = SourceModel(config, {n: ("BF16", s) for n, s in shapes.items()})
    for tp, pp in ((8, 2), (8, 4), (16, 1)):
        start = time.perf_counter()
        plan = make_plan(source, tp=tp, pp=pp, draft=source, draft_method="mtp")
        print(f"tp{tp} x pp{pp}: {len(plan.files)} rank files, {time.perf_counter() - start:.1f} s")
    return 0


def check_engine(tp: int, pp: int, root: Path) -> int:
    import vllm_env
    from test_vllm_layout import assert_same_state, rank_tensors

    from shardprep.convert.run import Options, convert
    from shardprep.demo.tiny import make_tiny_model
    from shardprep.format.manifest import read_manifest

    model = make_tiny_model(root / "model", ARCH, num_hidden_layers=2 * pp)
    artifact = root / "artifact"
    convert(str(model), artifact, Options(tp=tp, pp=pp), progress=False)
    shared = set(read_manifest(artifact).model("draft").shared_with_target)
    dumps = vllm_env.dump_state(
        model, tp, pp, root / "dump", dtype="bfloat16", speculative_config=MTP,
        allow_engine_failure=pp > 1,
    )  # fmt: skip
    assert sorted(dumps) == sorted(vllm_env.expected_dumps(tp, pp, with_draft=True))
    for (role, p, t), path in dumps.items():
        state, _ = vllm_env.read_dump(path)
        if role == "draft":
            state = {n: v for n, v in state.items() if n not in shared}
        assert_same_state(state, rank_tensors(artifact, role, p, t))
        print(f"{role} pp{p} tp{t}: {len(state)} parameters equal the rank file")
    if pp > 1:
        return 0
    default = vllm_env.generate(model, tp, 1, "auto", speculative_config=MTP, dtype="bfloat16")
    fast = vllm_env.generate(
        artifact, tp, 1, "sharded-fast", speculative_config=MTP, dtype="bfloat16",
        env={"SHARDPREP_TRAP_COLLECTIVES": "1"},
    )  # fmt: skip
    assert fast == default, (fast, default)
    print(f"sharded-fast, collectives trapped, speculating: the default loader's tokens {fast}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path("check-qwen3_5_moe"))
    parser.add_argument("--plan", action="store_true", help="plan the published config only")
    args = parser.parse_args()
    if args.plan:
        return plan_published()
    args.dir.mkdir(parents=True, exist_ok=True)
    return check_engine(args.tp, args.pp, args.dir)


if __name__ == "__main__":
    sys.exit(main())
