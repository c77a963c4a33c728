"""Tiny random models of architectures vLLM registers with an MTP draft and no shardprep
family names, built by transformers (which neither builds nor saves their MTP layers),
with the MTP layers their published checkpoints carry added:

- GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: MLA, routed and shared experts, a dense first
  layer), DeepSeek-style: after the decoder layers, a decoder layer of the target's sizes
  plus `enorm`, `hnorm`, `eh_proj`, `shared_head` and copies of the embedding and lm_head;
- Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`: DeltaNet and gated full attention,
  experts and a gated shared expert), `mtp.*`: a full-attention layer, `fc`, its norms.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from derived_models import save_random
from safetensors.torch import load_file, save_file

GLM = "Glm4MoeLiteForCausalLM"
QWEN35 = "Qwen3_5MoeForCausalLM"
LAYERS = 3  # GLM's MTP layer is model.layers.3
HIDDEN = 128
COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 256, "num_attention_heads": 4,
    "vocab_size": 1000, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip
# MLA sizes as the tiny DeepSeek-V3's (shardprep.demo.tiny_configs), which vLLM's CPU
# MLA takes.
GLM_CONFIG: dict[str, Any] = COMMON | {
    "num_hidden_layers": LAYERS, "num_key_value_heads": 4, "kv_lora_rank": 512,
    "q_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
    "moe_intermediate_size": 64, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1,
}  # fmt: skip
# Qwen3-Next's tiny sizes (linear head dims 128, which vLLM's CPU DeltaNet kernel needs).
QWEN35_CONFIG: dict[str, Any] = COMMON | {
    "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 32,
    "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "mtp_num_hidden_layers": 1,
}  # fmt: skip


def make_mtp_model(
    folder: Path, architecture: str = GLM, seed: int = 0, *, with_mtp: bool = True
) -> Path:
    """config.json, generation_config.json and model.safetensors (float32) of the tiny
    model of `architecture`, its MTP layer included (`with_mtp`; else as transformers
    saves it: config.json promises an MTP layer the checkpoint lacks)."""
    model_type, config, mtp = MODELS[architecture]
    save_random(folder, model_type, architecture, config, seed)
    if with_mtp:
        weights = folder / "model.safetensors"
        tensors = load_file(weights)
        generator = torch.Generator().manual_seed(seed + 1)
        save_file(tensors | mtp(tensors, generator), weights, metadata={"format": "pt"})
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return folder


def _like(
    tensors: dict[str, torch.Tensor], layer: str, prefix: str, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random tensors of decoder layer `layer`'s names and shapes, under `prefix`."""
    return {
        prefix + name.removeprefix(layer): torch.randn(t.shape, generator=generator) * 0.05
        for name, t in tensors.items()
        if name.startswith(layer)
    }


def _vector(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * 0.05


def glm_mtp(tensors: dict[str, torch.Tensor], generator: torch.Generator) -> dict:
    """The last decoder layer's names and shapes as layer LAYERS, its own norms and
    projection, copies of the embedding and the lm_head."""
    prefix = f"model.layers.{LAYERS}."
    found = _like(tensors, f"model.layers.{LAYERS - 1}.", prefix, generator)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        found[prefix + name] = _vector(generator, HIDDEN)
    found[prefix + "eh_proj.weight"] = _vector(generator, HIDDEN, 2 * HIDDEN)
    found[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    found[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return found


def qwen35_mtp(tensors: dict[str, torch.Tensor], generator: torch.Generator) -> dict:
    """A full-attention layer's names and shapes (layer 1) as mtp.layers.0, `mtp.fc`
    and the MTP norms."""
    found = _like(tensors, "model.layers.1.", "mtp.layers.0.", generator)
    found["mtp.fc.weight"] = _vector(generator, HIDDEN, 2 * HIDDEN)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        found[f"mtp.{name}.weight"] = _vector(generator, HIDDEN)
    return found


MTP = Callable[[dict[str, torch.Tensor], torch.Generator], dict[str, torch.Tensor]]
# architecture -> (transformers model_type, sizes, its MTP layers)
MODELS: dict[str, tuple[str, dict[str, Any], MTP]] = {
    GLM: ("glm4_moe_lite", GLM_CONFIG, glm_mtp),
    QWEN35: ("qwen3_5_moe_text", QWEN35_CONFIG, qwen35_mtp),
}
