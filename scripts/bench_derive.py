"""Time and peak memory of deriving a flagship layout from vLLM (plan/derived), headers
only: DeepSeek-V3's shapes (61 layers, 256 experts, MLA) in bfloat16, no MTP layer; or
Kimi-K3 as published (`--model kimi-k3`: 93 layers, 896 MXFP4 experts, KDA and MLA, the
vision tower; its config.json from tests/data).

    python scripts/bench_derive.py [--model deepseek-v3|kimi-k3] [--tp 8 --pp 2] [--layers N]

Nothing is read or written but config.json: the checkpoint is its tensor table. The
derived layout is then compared with the hand-written DeepSeek family's, piece for piece.
Prints one JSON line: seconds, this process's and the largest deriving child's peak RSS,
how many children derived (one a core, up to 4; SHARDPREP_DERIVE_CHILDREN sets it), ranks,
parameters, and how many differ from the hand-written layout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

from shardprep.demo.tiny import tiny_config
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext, config_int
from shardprep.plan.archs.parts import quantized
from shardprep.plan.derived import DerivedFamily, children, run
from shardprep.plan.drafts import with_target_rules
from shardprep.plan.topology import make_topology


def deepseek_v3_config(layers: int) -> dict:
    return tiny_config(
        "DeepseekV3ForCausalLM", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
        num_nextn_predict_layers=0, torch_dtype="bfloat16",
    )  # fmt: skip


def kimi_k3_config(layers: int | None) -> dict:
    """Kimi-K3's config.json as published (MXFP4 experts), `layers` of it if given."""
    config = json.loads(KIMI_K3.read_text())
    if layers is not None:
        config["text_config"]["num_hidden_layers"] = layers
    return config


MODELS = {"deepseek-v3": "DeepSeek-V3 shapes, bf16", "kimi-k3": "Kimi-K3 as published, MXFP4"}
KIMI_K3 = Path(__file__).resolve().parents[1] / "tests" / "data" / "kimi-k3" / "config.json"
ENVIRONMENT = {"kimi-k3": {"VLLM_KIMI_K3_GEMM_AR": "0"}}  # its GEMM without an all-reduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="deepseek-v3")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args()
    os.environ.update(ENVIRONMENT.get(args.model, {}))
    if args.model == "kimi-k3":
        published = kimi_k3_config(args.layers)
    else:
        published = deepseek_v3_config(args.layers or 61)
    config = archs.read_config(published)
    family = archs.target_family(config)[1]
    shapes = quantized.expected_shapes(family, config)
    topology = make_topology(config_int(config, "num_hidden_layers"), args.tp, args.pp, None, "")
    context = PlanContext(pp=args.pp)
    stored = PlanContext(pp=args.pp, dtypes=quantized.source_dtypes(family, config))
    start = time.perf_counter()
    derived = DerivedFamily().layout(published, shapes, topology, stored)
    seconds = time.perf_counter() - start
    layout = quantized.layout(family, config, shapes, topology, context)
    layout = with_target_rules(family, config, shapes, topology, layout, context)
    written = {p.name: p for p in layout.params}
    differ = [p.name for p in derived.params if written.get(p.name) != p]
    run.stop()  # a child's peak is counted once it has exited
    own = [line for line in Path("/proc/self/status").read_text().splitlines() if "VmHWM" in line]
    print(json.dumps({
        "model": MODELS[args.model], "tensors": len(shapes), "tp": args.tp,
        "pp": args.pp, "ranks": args.tp * args.pp, "seconds": round(seconds, 1),
        "children": children.how_many(args.tp * args.pp, len(shapes)),
        "peak_rss_parent": own[0].split(":")[1].strip(),
        "peak_rss_child_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        "params": len(derived.params), "differ_from_hand_written": len(differ),
        "first_differences": differ[:3],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
