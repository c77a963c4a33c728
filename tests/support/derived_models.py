"""Tiny random models of architectures vLLM registers and no shardprep family names,
built by transformers itself (its config classes and modules, its tensor names), for the
derived layout's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention takes 32, not 16
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# architecture -> (transformers model_type, overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # a fused qkv_proj and gate_up_proj in the checkpoint (equal q, k, v parts; fewer KV
    # heads than query heads where num_key_value_heads is given, as Phi-3-medium has)
    "Phi3ForCausalLM": ("phi3", {"num_key_value_heads": 4, "pad_token_id": 0}),
    "Gemma2ForCausalLM": ("gemma2", {"tie_word_embeddings": True}),
    "Gemma3ForCausalLM": ("gemma3_text", {"tie_word_embeddings": True, "sliding_window": 64}),
    "GraniteForCausalLM": ("granite", {"vocab_size": 1001}),
    "StableLmForCausalLM": ("stablelm", {"num_key_value_heads": 4}),
    # routed experts and a shared expert behind a gate
    "Qwen2MoeForCausalLM": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
        },
    ),
    "OlmoeForCausalLM": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    # q and k norms after the projections, norms after attention and MLP, sliding windows
    "Exaone4ForCausalLM": ("exaone4", {"sliding_window": 64}),
    # LayerNorm, attention and MLP in parallel from one norm, a logit scale, tied
    "CohereForCausalLM": ("cohere", {"tie_word_embeddings": True}),
    # experts stacked in one tensor per layer (input_linear [E, 2I, H]), a shared MLP,
    # Granite's multipliers
    "GraniteMoeSharedForCausalLM": (
        "granitemoeshared",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 128},
    ),
    # vLLM's load_weights computes A = -exp(A_log): no plan of copies expresses it
    "MambaForCausalLM": ("mamba", {"state_size": 8, "expand": 2, "conv_kernel": 4}),
}

# The cases tests/vllm/test_vllm_derived.py proves against a real vLLM, and
# docs/families.md names: case -> (architecture, what its tiny model changes).
PROVEN: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3-fused-qkv": ("Phi3ForCausalLM", {}),
    "phi3-fused-gqa-qkv": ("Phi3ForCausalLM", {"num_key_value_heads": 2}),
    "qwen2-moe-shared-expert": ("Qwen2MoeForCausalLM", {}),
    "gemma2-tied": ("Gemma2ForCausalLM", {}),
    "gemma3-text": ("Gemma3ForCausalLM", {}),
    "granite-odd-vocab": ("GraniteForCausalLM", {}),
    "stablelm": ("StableLmForCausalLM", {}),
    "olmoe": ("OlmoeForCausalLM", {}),
    "exaone4": ("Exaone4ForCausalLM", {}),
    "cohere-tied": ("CohereForCausalLM", {}),
    "granitemoe-shared-stacked-experts": ("GraniteMoeSharedForCausalLM", {}),
}


def save_random(
    folder: Path, model_type: str, architecture: str, sizes: dict[str, Any], seed: int
) -> None:
    """The model transformers builds of `sizes`, random values everywhere (norms
    included), saved as transformers saves it, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **sizes)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    model.save_pretrained(folder, safe_serialization=True)


def make_transformers_model(
    folder: Path, architecture: str, seed: int = 0, **overrides: Any
) -> Path:
    """config.json, generation_config.json and model.safetensors of a tiny random model
    of `architecture`, in float32, as transformers saves it."""
    model_type, own = MODELS[architecture]
    save_random(folder, model_type, architecture, {**COMMON, **own, **overrides}, seed)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return folder


def with_fp8_blocks(folder: Path, block: int = 128) -> Path:
    """The model in `folder` as an fp8 block checkpoint (DeepSeek's format, which vLLM
    reads as quant_method fp8): every linear projection of a layer (`*_proj.weight`,
    experts' included) stored in float8_e4m3fn with a float32 `weight_scale_inv` per
    `block` x `block` block; the rest as it was."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        weight = tensors[name].float()
        rows, cols = weight.shape
        blocks = weight.reshape(rows // block, block, cols // block, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0
        fp8 = (blocks / scale[:, None, :, None]).reshape(rows, cols)
        tensors[name] = fp8.to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
