"""The quantization_config of each tiny quantized model, as its published kind writes it."""

from __future__ import annotations

from typing import Any

# gpt-oss's quantization: MXFP4 experts, the rest in the model's dtype.
TINY_MXFP4 = {"quant_method": "mxfp4"}
TINY_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}  # fmt: skip
# DeepSeek-V4-Flash's quantization as published (with `expert_dtype: fp4` beside it in
# config.json): fp8 blocks with e8m0 scales, MXFP4 routed experts.
DEEPSEEK_V4_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}  # fmt: skip
# Kimi-K2-Thinking's quantization: int4 routed experts in groups of 32, the rest ignored.
TINY_INT4: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}},
    }},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip
# Kimi-K3's quantization of its routed experts: compressed-tensors MXFP4 (e2m1 values in
# groups of 32 sharing an e8m0 exponent), the rest ignored.
TINY_MXFP4_PACK: dict[str, Any] = {
    **TINY_INT4, "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}},
    }},
}  # fmt: skip
# Kimi-K3's quantization_config as published (in text_config): MXFP4 routed experts, no
# activation quantization. vLLM loads it through its MXFP4 interface, which quantizes the
# routed experts only (plan/archs/kimi_k3/quant.py).
KIMI_K3_MXFP4: dict[str, Any] = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None,
        "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": 32, "num_bits": 4, "observer": "minmax",
                    "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                    "symmetric": True, "type": "float", "zp_dtype": None},
    }},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}  # fmt: skip
# NVFP4 routed experts (compressed-tensors nvfp4-pack-quantized, W4A4: e2m1 values and
# activations in groups of 16 sharing an e4m3 scale, float32 global scales), the rest ignored.
_NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
          "group_size": 16, "dynamic": False, "actorder": None, "block_structure": None,
          "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
TINY_NVFP4_PACK = {
    **TINY_INT4, "format": "nvfp4-pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None, "weights": _NVFP4,
        "input_activations": {**_NVFP4, "dynamic": "local"},
    }},
}  # fmt: skip


# llm-compressor's `-NVFP4` quantization: every linear layer in NVFP4 (W4A4) but lm_head and
# the MoE routers; `-NVFP4A16`: the same weights with 16-bit activations.
TINY_NVFP4 = {**TINY_NVFP4_PACK, "ignore": ["lm_head", "re:.*mlp.gate$"]}
TINY_NVFP4A16 = {
    **TINY_NVFP4,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None, "weights": _NVFP4,
        "input_activations": None,
    }},
}  # fmt: skip


# ModelOpt's NVFP4 (`quant_algo: NVFP4`, W4A4) as config.json states it: every linear layer
# but lm_head and the MoE routers.
_FP4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
TINY_MODELOPT_NVFP4 = {
    "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
    "producer": {"name": "modelopt", "version": "0.37.0"}, "kv_cache_scheme": None,
    "ignore": ["lm_head", "model.layers.*.mlp.gate"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": _FP4, "input_activations": _FP4,
    }},
}  # fmt: skip


# llm-compressor's `-FP8-dynamic` quantization: fp8 weights per output channel, dynamic
# per-token activations, routers and lm_head left in the model's dtype.
TINY_FP8_CT: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "block_structure": None,
                    "observer": "minmax", "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                              "strategy": "token", "dynamic": True, "observer": None},
    }},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}  # fmt: skip
