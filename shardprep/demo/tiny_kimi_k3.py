"""A tiny Kimi-K3 config.json in the published layout: the text model (KDA and MLA
layers, latent experts, attention residuals) in `text_config`, a two-block MoonViT-3D in
`vision_config` under KimiK3VisionConfig's `vt_*` names.

Two departures from the published sizes keep it servable by vLLM's CPU build at tp2:
`hidden_act` is `silu` (the CPU build has no MoE backend for `situ`; the activation does
not change any tensor), and `min_moe_intermediate_per_partition` is 16, so that vLLM
does not zero-pad the experts' 16 intermediate rows per rank to 256.

With `quantization_config=KIMI_K3_MXFP4` (demo/quant_configs.py, the published block)
the routed experts are stored as Kimi-K3 publishes them, `weight_packed` and
`weight_scale` (demo/quantized.py's values); give them sizes in whole groups of 32 a rank
(`moe_intermediate_size=256` and `routed_expert_hidden_size=256`: sizes no MXFP4 MoE
backend pads at tp2; others are padded at load).
"""

from __future__ import annotations

import copy
from typing import Any

KIMI_K3 = "KimiK3ForConditionalGeneration"
TEXT: dict[str, Any] = {
    "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 8,
    "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "hidden_act": "silu", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "attn_res_block_size": 2, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0, "min_moe_intermediate_per_partition": 16,
    "linear_attn_config": {
        "full_attn_layers": [2, 4], "kda_layers": [1, 3], "gate_lower_bound": -5.0,
        "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
    },
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
VISION: dict[str, Any] = {
    "patch_size": 14, "vt_hidden_size": 64, "vt_num_hidden_layers": 2,
    "vt_num_attention_heads": 4, "vt_intermediate_size": 128, "qkv_hidden_size": 96,
    "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
}  # fmt: skip


def kimi_k3_config(**overrides: Any) -> dict[str, Any]:
    """config.json of a tiny Kimi-K3; `vision_config` and `torch_dtype` overrides go to the
    top level, every other key to `text_config`."""
    vision = overrides.pop("vision_config", VISION)
    dtype = overrides.pop("torch_dtype", "float32")
    text = copy.deepcopy(TEXT) | overrides
    return {
        "architectures": [KIMI_K3],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": copy.deepcopy(vision),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "media_placeholder_token_id": 250,
    }


# The published draft's own keys (Inferact/Kimi-K3-DSpark), at tiny sizes.
DSPARK: dict[str, Any] = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "mla_use_nope": False, "mla_use_output_gate": False, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096, "rope_theta": 50000.0,
    "markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True, "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}  # fmt: skip


def k3_dspark_config(target: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny DSpark draft (`K3DSparkModel`) for the Kimi-K3 `target`
    (its config.json): the published keys, the target's hidden size and vocabulary, two
    layers fed by the target's layers 1 and 2."""
    text = target["text_config"]
    ids = [1, 2]
    config = copy.deepcopy(DSPARK) | {
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
        "draft_vocab_size": text["vocab_size"],
        "target_hidden_size": text["hidden_size"],
        "target_num_hidden_layers": text["num_hidden_layers"],
        "target_layer_ids": ids,
        "mask_token_id": text["vocab_size"] - 3,  # as published: near the end
        "num_target_layers": len(ids),
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": target.get("pad_token_id", 0),
        "torch_dtype": target.get("torch_dtype", "float32"),
    }
    return config | overrides
