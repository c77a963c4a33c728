"""Time and peak memory of `shardprep plan` on DeepSeek-V3-shaped checkpoints.

    python scripts/bench_plan.py [--tp 8 --pp 2] [--dir DIR]
        [--model deepseek-v3|deepseek-v3.2|deepseek-v4[-bf16]|kimi-k2-thinking|kimi-k2.6|kimi-k3
                 |kimi-k3-mxfp4|kimi-k3-dspark|gpt-oss-120b|glm-4.5|qwen3-next
                 |qwen3-30b-a3b-fp4 ...]

Each checkpoint has a published model's full shapes but is made of sparse files: each is a
valid safetensors header followed by a hole, so it costs headers only on disk. `plan` reads
every header, lays out every rank file and validates it all; nothing is written.

- DeepSeek-V3: 61 layers and an MTP layer, 256 experts, fp8 blocks, 163 files;
- Kimi-K2-Thinking: 61 layers, 384 experts of int4 in groups of 32 (compressed-tensors
  `pack-quantized`: `weight_packed`, `weight_scale`, `weight_shape` per projection),
  everything else bf16, 62 files;
- DeepSeek-V4: DeepSeek-V4-Flash's published config.json (tests/data/deepseek-v4-flash) as
  published, 43 layers of fp8 blocks with e8m0 `.scale` tensors and 256 MXFP4 experts
  (int8 pairs, e8m0 scales), planned with `--no-mtp` (its DSpark stages left out), 46
  files; `deepseek-v4-bf16`: in bfloat16 with its built-in DSpark draft of 3 stages
  (`mtp.*`, planned into draft/), 48 files;
- gpt-oss-120b: 36 layers, 128 experts in MXFP4 (`*_blocks`, `*_scales`), the rest bf16,
  15 files; planned without `--mxfp4-pad` (the expert stacks unpadded);
- Kimi-K2.6 (as Kimi-K2.5 is published, tests/data/kimi-k2.5): Kimi-K2-Thinking's text
  model under `language_model.` with a MoonViT vision tower of 27 blocks and its projector,
  208,550 tensors in 64 files;
- Kimi-K3: its published config.json (tests/data/kimi-k3) in bfloat16, 93 layers (69 KDA,
  24 MLA), 896 latent experts, a vision tower of 27 blocks, the 249,924 tensors the family
  implies (about 2.78T parameters), 96 files; `kimi-k3-mxfp4`: as published, its routed
  experts in compressed-tensors MXFP4 (`weight_packed` and `weight_scale` per projection),
  everything else bfloat16, 96 files;
- Kimi-K3 with its DSpark draft (`kimi-k3-dspark`): the above and, as its own folder
  planned with `--draft DIR --draft-method dspark`, Inferact/Kimi-K3-DSpark's published
  config.json and 68 tensors (tests/data/kimi-k3-dspark), one file;
- GLM-4.5 and Qwen3-Next-80B-A3B: their published config.json (tests/data) in bfloat16,
  with the MTP layer the checkpoint ships (the plan skips it without `--draft`), 64 and 41
  files.
- Qwen3-30B-A3B in ModelOpt's NVFP4 (NVIDIA's `-FP4`): 48 layers, 128 experts, every linear
  layer but lm_head and the routers packed with group scales and two scalars each, 16 files.

The suite plans each published model at one topology (tests/plan); the other topologies
it is served with plan here, e.g. `--model kimi-k2.6 --tp 16 --pp 1`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

from shardprep.demo.tiny import TINY_FP8, TINY_INT4, TINY_MODELOPT_NVFP4, TINY_MXFP4, tiny_config
from shardprep.format.headers import TensorSpec, encode_header

# The child's own peak from /proc (VmHWM): getrusage's ru_maxrss also counts the parent's
# peak before the exec, which is this script's with the tables it built.
PLAN_CHILD = """
import json, sys, time
from pathlib import Path
from shardprep.cli import main
t = time.perf_counter()
code = main(["plan", "--tp", sys.argv[2], "--pp", sys.argv[3], "--quiet", *sys.argv[4:],
             sys.argv[1]])
seconds = time.perf_counter() - t
status = Path("/proc/self/status").read_text().splitlines()
(hwm,) = [int(line.split()[1]) for line in status if line.startswith("VmHWM:")]
print(json.dumps({"code": code, "seconds": seconds, "max_rss": hwm * 1024}))
"""


def deepseek_v3_config() -> dict:
    """DeepSeek-V3's config.json (fp8 blocks of 128 x 128, one MTP layer)."""
    return tiny_config(
        "DeepseekV3ForCausalLM", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
        num_nextn_predict_layers=1, quantization_config=TINY_FP8,
    )  # fmt: skip


def deepseek_v3_tensors(config: dict) -> tuple[dict, dict]:
    """DeepSeek-V3's tensors (name -> shape) and the dtypes that are not bfloat16."""
    from shardprep.plan import archs
    from shardprep.plan.archs.parts import quantized

    family = archs.target_family(config)[1]
    dtypes = quantized.source_dtypes(family, config)  # the fp8 weights and their scales
    shapes = dict(quantized.expected_shapes(family, config))
    # The MTP layer: one more decoder layer and its own heads; the target skips them.
    if not config.get("num_nextn_predict_layers"):
        return shapes, dtypes
    mtp = {k.replace("layers.60.", "layers.61."): v for k, v in shapes.items() if ".60." in k}
    dtypes |= {k.replace("layers.60.", "layers.61."): v for k, v in dtypes.items() if ".60." in k}
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    mtp |= {
        "model.layers.61.enorm.weight": (hidden,),
        "model.layers.61.hnorm.weight": (hidden,),
        "model.layers.61.eh_proj.weight": (hidden, 2 * hidden),
        "model.layers.61.shared_head.norm.weight": (hidden,),
        "model.layers.61.shared_head.head.weight": (vocab, hidden),
        "model.layers.61.embed_tokens.weight": (vocab, hidden),
    }
    return {**shapes, **mtp}, dtypes


def kimi_k2_thinking_config() -> dict:
    """Kimi-K2-Thinking's config.json: DeepSeek-V3's architecture with 384 experts, 64
    heads, int4 routed experts in groups of 32 and no MTP layer."""
    return tiny_config(
        "DeepseekV3ForCausalLM", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
        n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
        num_nextn_predict_layers=0, quantization_config=TINY_INT4,
    )  # fmt: skip


def gpt_oss_120b_config() -> dict:
    """gpt-oss-120b's config.json: MXFP4 experts (quant_method mxfp4)."""
    return tiny_config(
        "GptOssForCausalLM", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
        num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        quantization_config=TINY_MXFP4,
    )  # fmt: skip


def qwen3_30b_a3b_fp4_config() -> dict:
    """Qwen3-30B-A3B's config.json with ModelOpt's NVFP4 (quant_method modelopt)."""
    return tiny_config(
        "Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, torch_dtype="bfloat16", quantization_config=TINY_MODELOPT_NVFP4,
    )  # fmt: skip


def deepseek_v32_tensors() -> tuple[dict, dict, dict]:
    """DeepSeek-V3.2's published config.json and tensor table (tests/data/deepseek-v3.2)."""
    ranges = {"{L}": range(62), "{D}": range(3), "{M}": range(3, 62), "{E}": range(256)}
    return published_tensors("deepseek-v3.2", ranges)


def kimi_k26_tensors() -> tuple[dict, dict, dict]:
    """Kimi-K2.5's published config.json and tensor table (tests/data/kimi-k2.5), which
    Kimi-K2.6 shares."""
    ranges = {"{L}": range(61), "{D}": range(1), "{M}": range(1, 61), "{E}": range(384)}
    return published_tensors("kimi-k2.5", ranges | {"{B}": range(27)})


def published_tensors(folder: str, ranges: dict[str, range]) -> tuple[dict, dict, dict]:
    data = Path(__file__).resolve().parents[1] / "tests" / "data" / folder
    config = json.loads((data / "config.json").read_text())
    table = json.loads((data / "tensors.json").read_text())
    shapes, dtypes = {}, {}
    for pattern, (dtype, shape) in table["groups"].items():
        keys = [k for k in ranges if k in pattern]
        for values in itertools.product(*(ranges[k] for k in keys)):
            name = pattern
            for key, value in zip(keys, values, strict=True):
                name = name.replace(key, str(value))
            shapes[name] = tuple(shape)
            dtypes[name] = dtype
    return config, shapes, dtypes


def deepseek_v4_tensors(bf16: bool = False) -> tuple[dict, dict, dict]:
    """DeepSeek-V4-Flash's published config.json and the native tensors it implies (the
    families' own tables): as published, the target's in fp8 blocks with e8m0 `.scale`
    and MXFP4 experts (int8 pairs, e8m0 scales); `bf16`: in bfloat16, its DSpark draft's
    included."""
    from shardprep.plan import archs
    from shardprep.plan.archs.parts import quantized

    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepseek-v4-flash"
    published = json.loads((data / "config.json").read_text())
    if not bf16:
        family = archs.target_family(published)[1]
        shapes = quantized.expected_shapes(family, published)
        return published, shapes, quantized.source_dtypes(family, published)
    config = {k: v for k, v in published.items() if k != "quantization_config"}
    shapes: dict = {}
    dtypes: dict = {}
    for family in (archs.target_family(config)[1], archs.draft_family("dspark", "deepseek_v4")):
        shapes |= family.expected_shapes(config)
        dtypes |= family.source_dtypes(config)
    return config, shapes, dtypes


def with_mtp_tensors(folder: str) -> tuple[dict, dict, dict]:
    """A published config.json (tests/data) and the target's and its MTP layer's tensors
    that the families imply, in bfloat16 (GLM-4.5's routing bias in float32)."""
    from shardprep.plan import archs

    data = Path(__file__).resolve().parents[1] / "tests" / "data" / folder
    config = json.loads((data / "config.json").read_text())
    family = archs.target_family(config)[1]
    draft = archs.draft_family("mtp", family.name)
    shapes = family.expected_shapes(config) | draft.expected_shapes(config)
    return config, shapes, family.source_dtypes(config)


def kimi_k3_tensors(mxfp4: bool = False) -> tuple[dict, dict, dict]:
    """Kimi-K3's published config.json in bfloat16 (or as published, its routed experts in
    MXFP4) and the tensors it implies (the family's own table: no tensor table of the
    published checkpoint is stored)."""
    from shardprep.plan import archs
    from shardprep.plan.archs.parts import quantized

    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "kimi-k3"
    config = json.loads((data / "config.json").read_text())
    if not mxfp4:
        del config["text_config"]["quantization_config"]
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    shapes = quantized.expected_shapes(family, read)
    return config, shapes, quantized.source_dtypes(family, read)


def kimi_k3_dspark_tensors() -> tuple[dict, dict, dict]:
    """Kimi-K3's DSpark draft as published: its config.json and its 68 tensors."""
    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "kimi-k3-dspark"
    config = json.loads((data / "config.json").read_text())
    table = json.loads((data / "tensors.json").read_text())
    shapes, dtypes = {}, {}
    for pattern, (dtype, shape) in table["groups"].items():
        for layer in range(config["num_hidden_layers"]) if "{L}" in pattern else (None,):
            name = pattern.replace("{L}", str(layer))
            shapes[name], dtypes[name] = tuple(shape), dtype
    return config, shapes, dtypes


def write_sparse_deepseek_v3(folder: Path, files: int = 163, model: str = "deepseek-v3") -> int:
    """Headers only: each file is a valid safetensors header followed by a hole."""
    if model == "kimi-k3-dspark":
        config, shapes, dtypes = kimi_k3_dspark_tensors()
    elif model in ("kimi-k3", "kimi-k3-mxfp4"):
        config, shapes, dtypes = kimi_k3_tensors(mxfp4=model == "kimi-k3-mxfp4")
    elif model == "deepseek-v3.2":
        config, shapes, dtypes = deepseek_v32_tensors()
    elif model in ("deepseek-v4", "deepseek-v4-bf16"):
        config, shapes, dtypes = deepseek_v4_tensors(bf16=model == "deepseek-v4-bf16")
    elif model == "gpt-oss-120b":
        config = gpt_oss_120b_config()
        shapes, dtypes = deepseek_v3_tensors(config)
    elif model == "kimi-k2.6":
        config, shapes, dtypes = kimi_k26_tensors()
    elif model in PUBLISHED_WITH_MTP:
        config, shapes, dtypes = with_mtp_tensors(PUBLISHED_WITH_MTP[model])
    elif model == "qwen3-30b-a3b-fp4":
        config = qwen3_30b_a3b_fp4_config()
        shapes, dtypes = deepseek_v3_tensors(config)
    else:
        config = kimi_k2_thinking_config() if model == "kimi-k2-thinking" else deepseek_v3_config()
        shapes, dtypes = deepseek_v3_tensors(config)
    ordered = sorted(shapes.items(), key=_natural)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    per_file = math.ceil(len(ordered) / files)
    weight_map, total = {}, 0
    for index in range(files):
        name = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        specs = [
            TensorSpec(n, dtypes.get(n, "BF16"), s)
            for n, s in ordered[index * per_file : (index + 1) * per_file]
        ]
        header = encode_header(specs, {"format": "pt"})
        with open(folder / name, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + sum(spec.nbytes for spec in specs))
        weight_map.update({spec.name: name for spec in specs})
        total += (folder / name).stat().st_size
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    return total


DESCRIPTIONS = {
    "deepseek-v3": "DeepSeek-V3 (fp8, 163 files",
    "deepseek-v3.2": "DeepSeek-V3.2 (fp8, 163 files",
    "deepseek-v4": "DeepSeek-V4-Flash (fp8 + fp4 experts, as published, 46 files",
    "deepseek-v4-bf16": "DeepSeek-V4-Flash (bf16, 48 files",
    "kimi-k2-thinking": "Kimi-K2-Thinking (int4 experts, 62 files",
    "kimi-k2.6": "Kimi-K2.6 (int4 experts, vision tower, 64 files",
    "gpt-oss-120b": "gpt-oss-120b (mxfp4 experts, 15 files",
    "glm-4.5": "GLM-4.5 (bf16, MTP layer, 64 files",
    "qwen3-next": "Qwen3-Next-80B-A3B (bf16, MTP layer, 41 files",
    "qwen3-30b-a3b-fp4": "Qwen3-30B-A3B (ModelOpt nvfp4, 16 files",
    "kimi-k3": "Kimi-K3 (bf16, vision tower, 96 files",
    "kimi-k3-dspark": "Kimi-K3 (bf16, vision tower, 96 files) with its DSpark draft (1 file",
    "kimi-k3-mxfp4": "Kimi-K3 (mxfp4 experts, vision tower, 96 files",
}
FILES = {
    "kimi-k2-thinking": 62, "kimi-k2.6": 64, "gpt-oss-120b": 15, "deepseek-v4": 46,
    "deepseek-v4-bf16": 48,
    "glm-4.5": 64, "qwen3-next": 41, "qwen3-30b-a3b-fp4": 16, "kimi-k3": 96,
    "kimi-k3-mxfp4": 96,
}  # fmt: skip
PUBLISHED_WITH_MTP = {"glm-4.5": "glm-4.5", "qwen3-next": "qwen3-next-80b-a3b"}


def bench_plan_deepseek_v3(root: Path, tp: int, pp: int, model: str = "deepseek-v3") -> None:
    source = root / model
    shutil.rmtree(source, ignore_errors=True)
    folders, extra = [source], []
    draft_of = model == "kimi-k3-dspark"
    if model == "kimi-k3-dspark":  # the target, and the draft as its own folder
        total = write_sparse_deepseek_v3(source, FILES["kimi-k3"], "kimi-k3")
        draft = root / f"{model}-draft"
        shutil.rmtree(draft, ignore_errors=True)
        total += write_sparse_deepseek_v3(draft, 1, model)
        folders.append(draft)
        extra = ["--draft", str(draft), "--draft-method", "dspark"]
    else:
        total = write_sparse_deepseek_v3(source, FILES.get(model, 163), model)
    if model == "deepseek-v4":  # its DSpark stages are not in the table: the target alone
        extra = ["--no-mtp"]
    on_disk = sum(p.stat().st_blocks * 512 for f in folders for p in f.iterdir())
    result = subprocess.run(
        [sys.executable, "-c", PLAN_CHILD, str(source), str(tp), str(pp), *extra],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    run = json.loads(result.stdout.strip().splitlines()[-1])
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    flags = "--draft DRAFT --draft-method dspark" if draft_of else " ".join(extra)
    print(f"{DESCRIPTIONS[model]}, {total / 1e9:.0f} GB apparent, "
          f"{on_disk / 1e6:.1f} MB on disk): shardprep plan --tp {tp} --pp {pp} "
          f"{flags}".rstrip())  # fmt: skip
    print(f"  exit status {run['code']}, {run['seconds']:.2f} s, "
          f"peak RSS {run['max_rss'] / 1e6:.0f} MB")  # fmt: skip


def _natural(item: tuple[str, tuple[int, ...]]) -> list:
    return [int(part) if part.isdigit() else part for part in item[0].split(".")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dir", default="bench-plan")
    parser.add_argument(
        "--model", choices=sorted(DESCRIPTIONS), action="append",
        help="the checkpoint to plan (repeatable; default: deepseek-v3 and kimi-k2-thinking)",
    )  # fmt: skip
    args = parser.parse_args()
    for model in args.model or ["deepseek-v3", "kimi-k2-thinking"]:
        bench_plan_deepseek_v3(Path(args.dir), args.tp, args.pp, model)


if __name__ == "__main__":
    main()
