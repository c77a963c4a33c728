"""The config.json of each tiny model: every architecture's features at tiny sizes (the
nested configs of Kimi-K2.5, Kimi-K3 and Qwen3.5-MoE as published)."""

from __future__ import annotations

from typing import Any

from shardprep.demo.tiny_kimi_k3 import KIMI_K3, kimi_k3_config


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
