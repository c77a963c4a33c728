"""Tiny random models with real Hugging Face names and config.json, for the demo and
the tests. Tensor names and shapes come from the architecture families themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardprep.demo.quant_configs import (  # noqa: F401 (the tests import them from here)
    KIMI_K3_MXFP4,
    TINY_FP8,
    TINY_FP8_CT,
    TINY_INT4,
    TINY_MODELOPT_NVFP4,
    TINY_MXFP4,
    TINY_MXFP4_PACK,
    TINY_NVFP4,
    TINY_NVFP4_PACK,
    TINY_NVFP4A16,
)
from shardprep.demo.quantized import quantized_tensors
from shardprep.demo.tiny_kimi_k3 import KIMI_K3, kimi_k3_config
from shardprep.format.dtypes import MODEL_DTYPES, torch_dtype
from shardprep.plan import archs
from shardprep.plan.archs import quantized


def tiny_config(architecture: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    if architecture == KIMI_K3:
        return kimi_k3_config(**overrides)
    if architecture in KIMI_K25:
        return _kimi_k25_config(architecture, **overrides)
    if architecture == QWEN35_MOE:
        return _qwen3_5_moe_config(**overrides)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(_ARCH_DEFAULTS.get(architecture, {}))
    if architecture in DEEPSEEK:
        for key in ("head_dim", "num_key_value_heads"):
            del config[key]
        config.update(DEEPSEEK[architecture], torch_dtype="bfloat16")
    config.update(overrides)
    return config


# MLA with (V3) and without (V2-Lite) q_lora_rank; per-rank sizes are whole 128-blocks at
# tp2, so an fp8 variant (`quantization_config=TINY_FP8`) loads too.
_MLA = {
    "kv_lora_rank": 512, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
    "moe_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 0,
    "rope_scaling": None, "attention_bias": False,
}  # fmt: skip
DEEPSEEK: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": _MLA | {
        "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "scoring_func": "softmax",
    },
    "DeepseekV3ForCausalLM": _MLA | {
        "q_lora_rank": 128, "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1,
        "scoring_func": "sigmoid",
    },
}  # fmt: skip
# DeepSeek-V3.2: V3 with the indexer (index_head_dim 128, vLLM's quantization block).
DEEPSEEK["DeepseekV32ForCausalLM"] = DEEPSEEK["DeepseekV3ForCausalLM"] | {
    "index_n_heads": 4, "index_head_dim": 128, "index_topk": 16,
}  # fmt: skip
# Kimi-K2.5: a tiny DeepSeek-V3 text model and a tiny MoonViT (4 heads, 2 blocks).
KIMI_K25 = {"KimiK25ForConditionalGeneration": "kimi_k25"}
TINY_MOONVIT = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "patch_size": 14, "init_pos_emb_height": 4,
    "init_pos_emb_width": 4, "init_pos_emb_time": 4, "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "pos_emb_type": "divided_fixed",
    "video_attn_type": "spatial_temporal", "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
}  # fmt: skip


def _kimi_k25_config(architecture: str, **overrides: Any) -> dict[str, Any]:
    """The nested config.json of Kimi-K2.5 as published: the text model's sizes (the
    overrides but `vision_config` and `quantization_config`) in `text_config`."""
    top = {k: overrides.pop(k) for k in ("vision_config", "quantization_config") if k in overrides}
    text = tiny_config("DeepseekV3ForCausalLM", **overrides)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": KIMI_K25[architecture],
        "text_config": text,
        "vision_config": top.get("vision_config", TINY_MOONVIT),
        "tie_word_embeddings": False,
        "torch_dtype": text["torch_dtype"],
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "media_placeholder_token_id": 5,
        "image_token_id": 5,
    }
    if "quantization_config" in top:
        config["quantization_config"] = top["quantization_config"]
    return config


# Qwen3.5-MoE as published: Qwen3-Next's tiny text model (every layer with experts, the
# separate DeltaNet projections, `mtp_num_hidden_layers`) in `text_config`, a tiny vision tower.
QWEN35_MOE = "Qwen3_5MoeForConditionalGeneration"
TINY_QWEN3_VL = {
    "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "in_channels": 3,
    "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128,
    "num_position_embeddings": 16, "deepstack_visual_indexes": [],
    "hidden_act": "gelu_pytorch_tanh",
}  # fmt: skip


def _qwen3_5_moe_config(**overrides: Any) -> dict[str, Any]:
    vision = overrides.pop("vision_config", TINY_QWEN3_VL)
    text = tiny_config("Qwen3NextForCausalLM", **overrides)
    for key in (
        "architectures",
        "num_nextn_predict_layers",
        "decoder_sparse_step",
        "mlp_only_layers",
    ):
        text.pop(key, None)
    text.update(model_type="qwen3_5_moe_text", mtp_num_hidden_layers=1)
    return {
        "architectures": [QWEN35_MOE], "model_type": "qwen3_5_moe", "text_config": text,
        "vision_config": vision, "tie_word_embeddings": False, "torch_dtype": text["torch_dtype"],
        "image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 7,
        "vision_end_token_id": 8,
    }  # fmt: skip


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# Mixture-of-experts sizes: 8 experts, 2 per token.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "MixtralForCausalLM": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 128,
    },
    # GLM-4.5's features at tiny sizes: qkv bias, q/k norms, partial rotary, a dense
    # first layer, one shared expert; bfloat16, as published (the router stays float32).
    "Glm4MoeForCausalLM": {
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "attention_bias": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
    },
    # DeepSeek-V4's native config keys at tiny sizes: head_dim 512 and index_head_dim 128
    # (the only sizes vLLM's compressor implements), one hash-routed layer, layers of
    # compress ratio 0 (sliding window), 4 (compressor and indexer) and 128, and a DSpark
    # draft of two stages; bfloat16.
    "DeepseekV4ForCausalLM": {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 64,
        "o_lora_rank": 64,
        "o_groups": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "num_hash_layers": 1,
        "compress_ratios": [0, 4, 128, 4, 0],
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 16,
        "sliding_window": 16,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 2,
        "hc_eps": 1e-6,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "compress_rope_theta": 160000.0,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 64,
        },
        "num_nextn_predict_layers": 0,
        # its built-in DSpark draft (mtp.0 and mtp.1), as the published config names it
        "dspark_target_layer_ids": [1, 2],
        "dspark_markov_rank": 16,
        "dspark_block_size": 3,
        "dspark_noise_token_id": 999,
        "n_mtp_layers": 2,
        "torch_dtype": "bfloat16",
    },
    # gpt-oss's features at tiny sizes: attention sinks, biases everywhere, 4 fused experts
    # (gate/up interleaved), sliding window on even layers, yarn rotary; bfloat16.
    "GptOssForCausalLM": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 128,
        "sliding_window": 8,
        "attention_bias": True,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "swiglu_limit": 7.0,
        "torch_dtype": "bfloat16",
    },
    # Qwen3-Next's features at tiny sizes: linear and full attention layers in turn, gated
    # attention with q/k norms, partial rotary, 8 experts and a gated shared expert, one
    # MTP layer; linear head dims 128, which vLLM's CPU DeltaNet kernel needs; bfloat16.
    "Qwen3NextForCausalLM": {
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
    },
}


def make_tiny_model(
    folder: Path,
    architecture: str = "LlamaForCausalLM",
    *,
    files: int = 1,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write config.json, generation_config.json and random safetensors weights (with an
    index when `files` > 1) into `folder`."""
    config = tiny_config(architecture, **overrides)
    read = archs.read_config(config)  # as vLLM reads it (Kimi-K2.5's text_config at the top)
    _, family = archs.target_family(read)
    families = [family]
    internal = archs.internal_draft_method(read)
    if internal:  # the draft layers the checkpoint carries (DeepSeek-V3's MTP layers)
        families.append(archs.draft_family(internal, family.name))
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    plain: dict[str, tuple[int, ...]] = {}  # the weights' own shapes, before any quantization
    for part in families:
        shapes |= quantized.expected_shapes(part, read)
        dtypes |= quantized.source_dtypes(part, read)
        plain |= part.expected_shapes(read)
    tensors = _random_tensors(shapes, config["torch_dtype"], seed)
    for part in families[1:]:  # a draft's copies of target tensors are copies, as published
        for copy, original in part.shared_copies(read).items():
            tensors[copy] = tensors[original].clone()
    if dtypes:
        tensors.update(quantized_tensors(tensors, dtypes, plain, seed))
    generator = torch.Generator().manual_seed(seed + 2)
    for part in families:  # index tables hold valid indices (a hash router's experts)
        for name, (low, high) in sorted(part.index_ranges(config).items()):
            shape = tuple(tensors[name].shape)
            tensors[name] = torch.randint(low, high, shape, generator=generator).to(torch.int32)
    _write_model(folder, config, tensors, files)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


def make_tiny_draft(
    folder: Path,
    target: Path,
    method: str = "eagle3",
    *,
    seed: int = 1,
    omit: tuple[str, ...] = (),
    **overrides: Any,
) -> Path:
    """An EAGLE, EAGLE3, DFlash or DSpark head for the tiny model in `target`, without
    the optional tensors named in `omit` (a DFlash-style draft never holds the mask
    embedding, which comes from a side file, nor vocabulary tables for a full vocabulary)."""
    target_config = json.loads((target / "config.json").read_text())
    config = {
        key: target_config[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "hidden_act",
            "torch_dtype",
            "bos_token_id",
            "eos_token_id",
        )
    }
    config.update(
        architectures=["LlamaForCausalLMEagle3" if method == "eagle3" else "LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )
    config.update(_DFLASH_STYLE.get(method, {}))
    if method in _DFLASH_STYLE:
        # The target layers whose states feed the draft's fc (zero-based), and a mask
        # token inside the vocabulary.
        layers = target_config["num_hidden_layers"]
        ids = [max(0, layers - 3 + i) for i in range(3)]
        key = "dflash_config" if method == "dflash" else "target_layer_ids"
        config[key] = {"mask_token_id": 3, "target_layer_ids": ids} if method == "dflash" else ids
    if method == "eagle3":
        layers = target_config["num_hidden_layers"]
        config["draft_vocab_size"] = min(512, target_config["vocab_size"])
        # vLLM's default (2, L // 2, L - 3) collapses for tiny targets; name three layers.
        config["eagle_aux_hidden_state_layer_ids"] = [max(0, layers - 3 + i) for i in range(3)]
    config.update(overrides)
    family = archs.draft_family(method, archs.target_family(target_config)[1].name)
    shapes = family.expected_shapes(config, target_config=target_config)
    if method in _DFLASH_STYLE:
        omit = (*omit, "mask_embedding", "d2t", "t2d")
    shapes = {name: shape for name, shape in shapes.items() if name not in omit}
    tensors = _random_tensors(shapes, config["torch_dtype"], seed)
    tensors.update(family.example_tables(config, target_config=target_config, seed=seed))
    _write_model(folder, config, tensors, 1)
    return folder


_DFLASH_STYLE: dict[str, dict[str, Any]] = {
    "dflash": {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4},
    "dspark": {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "block_size": 4,
        "markov_rank": 16,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    },
}


def write_mask_embedding(folder: Path, seed: int = 2) -> Path:
    """The side file some DFlash drafts ship: {"embedding", "mask_token_id"}, as vLLM
    reads it (`torch.load(weights_only=True)`)."""
    config = json.loads((folder / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(config["hidden_size"], generator=generator)
    token = config["dflash_config"]["mask_token_id"]
    path = folder / "mask_embedding.pt"
    torch.save(
        {
            "embedding": embedding.to(torch_dtype(torch, MODEL_DTYPES[config["torch_dtype"]])),
            "mask_token_id": token,
        },
        path,
    )
    return path


def _random_tensors(
    shapes: dict[str, tuple[int, ...]], dtype: str, seed: int
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        # 1-D weights are norms (around 1) or biases; 2-D are projections.
        values = 1.0 + 0.1 * values if len(shape) == 1 else 0.05 * values
        tensors[name] = values.to(torch_dtype(torch, MODEL_DTYPES[dtype]))
    return tensors


def _write_model(
    folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], files: int
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = sorted(tensors)
    if files == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        chunk = names[i::files]
        save_file({n: tensors[n] for n in chunk}, folder / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
