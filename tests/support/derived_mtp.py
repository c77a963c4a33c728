"""A tiny random model of an architecture vLLM registers with an MTP draft and no
shardprep family names: GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: MLA, routed and shared
experts, a dense first layer), built by transformers, with the MTP layer its checkpoints
publish after the decoder layers (transformers neither builds nor saves it): a decoder
layer of the target's sizes plus `enorm`, `hnorm`, `eh_proj`, `shared_head` and copies
of the embedding and lm_head, as DeepSeek-style MTP checkpoints hold them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ARCHITECTURE = "Glm4MoeLiteForCausalLM"
LAYERS = 3  # the MTP layer is model.layers.3
# MLA sizes as the tiny DeepSeek-V3's (shardprep.demo.tiny_configs), which vLLM's CPU
# MLA takes.
CONFIG: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
    "max_position_embeddings": 256, "kv_lora_rank": 512, "q_lora_rank": 128,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
    "moe_intermediate_size": 64, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def make_mtp_model(folder: Path, seed: int = 0) -> Path:
    """config.json, generation_config.json and model.safetensors (float32) of the tiny
    model, its MTP layer included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("glm4_moe_lite", **CONFIG)
    config.architectures = [ARCHITECTURE]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random values everywhere, norms included
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors |= mtp_layer(tensors, seed)
    save_file(tensors, weights, metadata={"format": "pt"})
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return folder


def mtp_layer(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors: the last decoder layer's names and shapes, random, plus
    its own norms and projection, and copies of the embedding and the lm_head."""
    generator = torch.Generator().manual_seed(seed + 1)
    last, prefix = f"model.layers.{LAYERS - 1}.", f"model.layers.{LAYERS}."
    hidden = CONFIG["hidden_size"]

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * 0.05

    found = {
        prefix + name.removeprefix(last): random(*t.shape)
        for name, t in tensors.items()
        if name.startswith(last)
    }
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        found[prefix + name] = random(hidden)
    found[prefix + "eh_proj.weight"] = random(hidden, 2 * hidden)
    found[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    found[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return found
