"""Published models at tiny widths: each published config.json in tests/data with its
counts (layers, experts, heads, layer kinds, MTP layers, files) kept and its widths made
small, in bfloat16, written as a checkpoint of as many files as the published one.

    flagship_config(name) -> config.json
    write_checkpoint(folder, config, files) -> folder
    write_draft(folder, name, target_config) -> folder, or None for a model without one
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from shardprep.format.headers import TensorSpec, encode_header
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.archs.parts import quantized

DATA = Path(__file__).resolve().parents[1] / "data"
# Each published model: its folder in tests/data, its files, the topology it is served at.
FLAGSHIPS = {
    "kimi-k3": ("kimi-k3", 96, (8, 2)),
    "deepseek-v3.2": ("deepseek-v3.2", 163, (8, 2)),
    "kimi-k2.5": ("kimi-k2.5", 64, (8, 2)),
    "glm-4.5": ("glm-4.5", 93, (8, 2)),
    "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b", 41, (4, 2)),
    "qwen3.6-35b-a3b": ("qwen3.6-35b-a3b", 26, (4, 1)),
    "gpt-oss-120b": ("gpt-oss-120b", 15, (8, 1)),
}
# The published draft that is its own model, by the target's name: its folder in tests/data.
DRAFTS = {"kimi-k3": "kimi-k3-dspark"}
# Widths, where a config names them; every count is left as published.
WIDTHS = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "routed_expert_hidden_size": 32,
    "min_moe_intermediate_per_partition": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "head_dim": 8,
    "vocab_size": 512, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "o_lora_rank": 16,
}  # fmt: skip
VISION_WIDTHS = {
    "vt_hidden_size": 48, "vt_intermediate_size": 64, "qkv_hidden_size": 48,
    "hidden_size": 48, "intermediate_size": 64, "out_hidden_size": 64,
}  # fmt: skip


def flagship_config(name: str) -> dict[str, Any]:
    """The published config.json of `name` at tiny widths, in bfloat16."""
    folder, _, _ = FLAGSHIPS[name]
    config = json.loads((DATA / folder / "config.json").read_text())
    config.pop("quantization_config", None)
    text = config.get("text_config", config)
    text.pop("quantization_config", None)
    text.update({k: v for k, v in WIDTHS.items() if k in text or k == "vocab_size"})
    if "linear_attn_config" in text:  # Kimi-K3's KDA heads
        text["linear_attn_config"] = dict(text["linear_attn_config"], head_dim=8)
    if "vision_config" in config:
        vision = config["vision_config"]
        config["vision_config"] = vision | {k: v for k, v in VISION_WIDTHS.items() if k in vision}
        if config.get("model_type") == "kimi_k3":  # its tower's other widths are defaults
            config["vision_config"] |= {"vt_intermediate_size": 64, "qkv_hidden_size": 48}
        if config.get("model_type") == "kimi_k25":  # vLLM reads these, not the vt_* names
            config["vision_config"] |= {"hidden_size": 48, "intermediate_size": 64}
    if "routed_expert_hidden_size" in text:  # Kimi-K3: vLLM pads fewer rows than this
        text["min_moe_intermediate_per_partition"] = WIDTHS["min_moe_intermediate_per_partition"]
    for top in (config, text):
        top["torch_dtype"] = "bfloat16"
    return copy.deepcopy(config)


def write_checkpoint(folder: Path, config: dict[str, Any], files: int) -> Path:
    """config.json and the tensors the family's own table implies for it (its MTP layers
    too), random bytes, in `files` files with an index."""
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    shapes = quantized.expected_shapes(family, read)
    internal = archs.internal_draft_method(read)
    if internal:
        shapes |= archs.draft_family(internal, family.name).expected_shapes(read)
    names = sorted(shapes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    per_file = math.ceil(len(names) / files)
    generator = np.random.default_rng(0)
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(files):
        name = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        chunk = names[index * per_file : (index + 1) * per_file]
        specs = [TensorSpec(n, "BF16", tuple(shapes[n])) for n in chunk]
        size = sum(spec.nbytes for spec in specs)
        with open(folder / name, "wb") as handle:
            handle.write(encode_header(specs, {"format": "pt"}))
            handle.write(_finite_bf16(generator, size))
        weight_map.update(dict.fromkeys(chunk, name))
        total += size
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc))
    return folder


def write_draft(folder: Path, name: str, target: dict[str, Any]) -> Path | None:
    """The published draft of `name` (DSpark for Kimi-K3) at the target's tiny widths, its
    counts (layers, heads, the target layers it reads) as published; None without one."""
    if name not in DRAFTS:
        return None
    config = json.loads((DATA / DRAFTS[name] / "config.json").read_text())
    text = target.get("text_config", target)
    config.update({k: v for k, v in WIDTHS.items() if k in config})
    vocab = text["vocab_size"]
    config.update(
        hidden_size=text["hidden_size"], target_hidden_size=text["hidden_size"],
        draft_vocab_size=vocab, mask_token_id=vocab - 3, bos_token_id=1, eos_token_id=2,
        pad_token_id=vocab - 1, markov_rank=16,
    )  # fmt: skip
    family = archs.draft_family("dspark", archs.target_family(archs.read_config(target))[1].name)
    shapes = family.expected_shapes(config, PlanContext(target_config=target))
    shapes.pop("lm_head.weight", None)  # as published: the embedding only
    names = sorted(shapes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    specs = [TensorSpec(n, "BF16", tuple(shapes[n])) for n in names]
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(encode_header(specs, {"format": "pt"}))
        handle.write(_finite_bf16(np.random.default_rng(1), sum(s.nbytes for s in specs)))
    return folder


def _finite_bf16(generator: np.random.Generator, size: int) -> bytes:
    """Random bfloat16 values of magnitude below 2 (no NaN or infinity)."""
    values = generator.integers(0, 1 << 16, size // 2, dtype=np.uint16)
    values &= 0xBFFF  # exponent below 128: finite, |x| < 2
    return values.tobytes()
