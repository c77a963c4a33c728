"""A tokenizer and image/video processor configs for a tiny Qwen3-VL-style checkpoint
(Qwen3.5), so that vLLM builds its multimodal processor and with it the vision tower.

    add_qwen_vl_processor(model_dir)

The tokenizer is a word-level one over the text model's vocabulary: ``t<id>`` for every id,
the vision tokens of config.json at their ids. Prompts stay token ids; vLLM needs the
tokenizer only to build the processor (it refuses one without)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VISION_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def add_qwen_vl_processor(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    special = {config[key]: token for key, token in VISION_TOKENS.items()}
    special[text["eos_token_id"]] = "<|endoftext|>"
    vocab = {special.get(i, f"t{i}"): i for i in range(text["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", eos_token="<|endoftext|>",
        additional_special_tokens=list(VISION_TOKENS.values()),
    ).save_pretrained(model_dir)  # fmt: skip
    patches = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "size": {"shortest_edge": 64, "longest_edge": 64 * 64},  # pixels: 1 to 64 tokens
        "processor_class": "Qwen3VLProcessor",
    }
    for name, key, kind in (
        ("preprocessor_config.json", "image_processor_type", "Qwen2VLImageProcessor"),
        ("video_preprocessor_config.json", "video_processor_type", "Qwen3VLVideoProcessor"),
    ):
        (model_dir / name).write_text(json.dumps({key: kind, **patches}, indent=1))
