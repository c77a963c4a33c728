"""Tiny random models with real Hugging Face names and config.json, for the demo and
the tests. Tensor names and shapes come from the architecture families themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardprep.demo.quant_configs import (  # noqa: F401 (the tests import them from here)
    DEEPSEEK_V4_FP8,
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
from shardprep.demo.tiny_configs import TINY_MOONVIT, tiny_config  # noqa: F401 (as above)
from shardprep.demo.tiny_kimi_k3 import KIMI_K3, k3_dspark_config
from shardprep.format.dtypes import MODEL_DTYPES, torch_dtype
from shardprep.plan import archs
from shardprep.plan.archs.base import PlanContext
from shardprep.plan.archs.parts import quantized
from shardprep.plan.quant import Example


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
    internal = archs.internal_draft_method(read)
    # The draft layers the checkpoint carries (DeepSeek-V3's MTP layers).
    drafts = [archs.draft_family(internal, family.name)] if internal else []
    families = [family, *drafts]
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    examples: dict[str, Example] = {}  # what each tensor a scheme stores holds
    for part in families:
        shapes |= quantized.expected_shapes(part, read)
        dtypes |= quantized.source_dtypes(part, read)
        examples |= quantized.examples(part, read)
    tensors = _random_tensors(shapes, config["torch_dtype"], seed)
    for draft in drafts:  # a draft's copies of target tensors are copies, as published
        for copy, original in draft.shared_copies(read).items():
            tensors[copy] = tensors[original].clone()
    if dtypes:
        tensors.update(quantized_tensors(tensors, dtypes, examples, seed))
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
    """An EAGLE, EAGLE3, DFlash or DSpark head (Kimi-K3's own DSpark draft for a Kimi-K3
    target) for the tiny model in `target`, without the optional tensors named in `omit`
    (a DFlash-style draft never holds the mask embedding, which comes from a side file,
    nor vocabulary tables for a full vocabulary; Kimi-K3's, as published, no lm_head)."""
    target_config = json.loads((target / "config.json").read_text())
    if method == "dspark" and KIMI_K3 in (target_config.get("architectures") or []):
        config = k3_dspark_config(target_config, **overrides)
        omit = (*omit, "lm_head.weight")  # as published: the embedding only
    else:
        config = _draft_config(target_config, method, overrides)
    family = archs.draft_family(method, archs.target_family(target_config)[1].name)
    shapes = family.expected_shapes(config, PlanContext(target_config=target_config))
    if method in _DFLASH_STYLE:
        omit = (*omit, "mask_embedding", "d2t", "t2d")
    shapes = {name: shape for name, shape in shapes.items() if name not in omit}
    tensors = _random_tensors(shapes, config["torch_dtype"], seed)
    tensors.update(family.example_tables(config, target_config=target_config, seed=seed))
    _write_model(folder, config, tensors, 1)
    return folder


def _draft_config(
    target_config: dict[str, Any], method: str, overrides: dict[str, Any]
) -> dict[str, Any]:
    """config.json of a Llama-style EAGLE, EAGLE3, DFlash or DSpark head."""
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
    return config


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
