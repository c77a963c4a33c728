"""Kimi-K3's text model: its sizes as config.json gives them and the tensors, and the
parameters each decoder layer holds (the rules: kimi_k3.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import Config, Count, config_count, config_int, moe_layers
from shardprep.plan.archs.parts.mla import F32, Tensor, mla_sizes, mlp_tensors
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.experts import w2_pieces, w13_pieces

TEXT = "language_model."
MODEL = TEXT + "model."
EMBED = MODEL + "embed_tokens.weight"
NORM = MODEL + "norm.weight"
HEAD = TEXT + "lm_head.weight"
LAYER = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
OUT_RES = (MODEL + "output_attn_res_norm.weight", MODEL + "output_attn_res_proj.weight")
TOP_KEYS = ("architectures", "model_type", "torch_dtype", "dtype")
KDA_ALIGN = 16  # vLLM pads each rank's in_proj_qkvgfab rows to this (unquantized)
MIN_MOE_PER_RANK = 256  # vLLM's default `min_moe_intermediate_per_partition`


@dataclass(frozen=True)
class K3Dims:
    """The text model's sizes, as vLLM's KimiLinearConfig reads them."""

    hidden: int
    vocab: int
    layers: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    output_gate: bool
    intermediate: int
    moe_intermediate: int
    experts: int
    shared: int
    latent: int | None
    latent_norm: bool
    first_dense: int
    moe_freq: int
    kda_layers: frozenset[int]  # 0-based
    kda_heads: int
    kda_head_dim: int
    kernel: int
    full_rank_gate: bool
    attn_res: bool
    min_moe_per_rank: int

    @classmethod
    def of(cls, config: Config) -> K3Dims:
        linear = config.get("linear_attn_config") or {}
        if not isinstance(linear, Mapping):
            raise ConfigError("config.json's linear_attn_config is not an object; fix it")
        experts = config.get("num_experts")
        latent = config.get("routed_expert_hidden_size")
        return cls(
            hidden=config_int(config, "hidden_size"),
            vocab=config_int(config, "vocab_size"),
            layers=config_int(config, "num_hidden_layers"),
            heads=config_int(config, "num_attention_heads"),
            **mla_sizes(config),
            output_gate=bool(config.get("mla_use_output_gate", False)),
            intermediate=config_int(config, "intermediate_size"),
            moe_intermediate=int(config.get("moe_intermediate_size") or 0),
            experts=int(experts or 0),
            shared=int(config.get("num_shared_experts") or 0),
            latent=int(latent) if latent else None,
            latent_norm=bool(config.get("latent_moe_use_norm", False)),
            first_dense=int(config.get("first_k_dense_replace") or 0),
            moe_freq=int(config.get("moe_layer_freq") or 1),
            kda_layers=frozenset(int(i) - 1 for i in linear.get("kda_layers") or ()),
            kda_heads=int(linear.get("num_heads") or 0),
            kda_head_dim=int(linear.get("head_dim") or 0),
            kernel=int(linear.get("short_conv_kernel_size") or 0),
            full_rank_gate=bool(linear.get("use_full_rank_gate", False)),
            attn_res=config.get("attn_res_block_size") is not None,
            min_moe_per_rank=int(
                config.get("min_moe_intermediate_per_partition") or MIN_MOE_PER_RANK
            ),
        )

    def beyond_layers(self, name: str) -> bool:
        """Whether `name` is a tensor of a text layer past the target's last (an MTP layer)."""
        match = LAYER.match(name)
        return match is not None and int(match[1]) >= self.layers

    @classmethod
    def counted(cls, config: Config) -> K3Dims:
        """The sizes, once the counts config.json holds are whole numbers."""
        config_int(config, "moe_layer_freq", 1)  # vLLM divides by it
        for key in ("num_experts", "num_shared_experts", "first_k_dense_replace"):
            config_count(config, key)
        config_count(config, "num_nextn_predict_layers")
        return cls.of(config)

    def counts(self, mtp: range) -> list[Count]:
        """The routed experts of the decoder layers (three tensors each), and the `mtp`
        layers, each with tensors of its own and experts where it holds them."""
        moe = moe_layers(range(self.layers), self.first_dense, self.moe_freq) if self.experts else 0
        in_mtp = moe_layers(mtp, self.first_dense, self.moe_freq) if self.experts else 0
        return [
            Count("num_experts", self.experts, 3 * self.experts * moe),
            Count("num_nextn_predict_layers", len(mtp), len(mtp) + 3 * self.experts * in_mtp),
        ]

    def is_moe(self, layer: int) -> bool:
        """vLLM's `KimiDecoderLayer.is_moe_layer`."""
        return bool(self.experts) and layer >= self.first_dense and layer % self.moe_freq == 0

    def problems(self, tp: int) -> list[str]:
        problems = []
        if self.kda_layers and not self.full_rank_gate:
            problems.append(
                "linear_attn_config.use_full_rank_gate is false; vLLM builds Kimi-K3's KDA "
                "layers with the full-rank gate only (this is a Kimi-Linear config)"
            )
        for what, size in (
            ("num_attention_heads", self.heads),
            ("linear_attn_config.num_heads", self.kda_heads),
            ("intermediate_size", self.intermediate),
            ("num_shared_experts x moe_intermediate_size", self.shared * self.moe_intermediate),
        ):
            if size and size % tp:
                problems.append(
                    f"{what} ({size}) is not divisible by tp={tp}; choose a tp that divides it"
                )
        if self.experts and self.moe_intermediate % tp == 0 and tp > 1:
            per_rank = self.moe_intermediate // tp
            if per_rank < self.min_moe_per_rank:
                problems.append(
                    f"at tp={tp} each rank holds {per_rank} of the experts' "
                    f"{self.moe_intermediate} intermediate rows, fewer than "
                    f"min_moe_intermediate_per_partition ({self.min_moe_per_rank}), and vLLM "
                    "zero-pads them to that, a layout shardprep does not write yet; choose a "
                    f"tp of at most {self.moe_intermediate // self.min_moe_per_rank}"
                )
        return problems

    # -- the tensors of one layer -------------------------------------------------------

    def kda_tensors(self) -> list[Tensor]:
        a, p, hd = "self_attn.", self.kda_heads * self.kda_head_dim, self.kda_head_dim
        fused, conv = a + "in_proj_qkvgfab.weight", a + "conv1d.weight"
        h = self.hidden
        return [
            *(Tensor(a + f"{x}_proj.weight", (p, h), Cut.ROWS, True, fused) for x in "qkvg"),
            Tensor(a + "f_a_proj.weight", (hd, h), Cut.REPLICATE, True, fused),
            Tensor(a + "b_proj.weight", (self.kda_heads, h), Cut.ROWS, True, fused),
            *(
                Tensor(a + f"{x}_conv1d.weight", (p, 1, self.kernel), Cut.ROWS, False, conv, F32)
                for x in "qkv"
            ),
            Tensor(a + "f_b_proj.weight", (p, hd), Cut.ROWS, True),
            Tensor(a + "dt_bias", (p,), Cut.ROWS, dtype=F32),
            Tensor(a + "A_log", (self.kda_heads,), Cut.ROWS, dtype=F32),
            Tensor(a + "o_norm.weight", (hd,), Cut.REPLICATE),
            Tensor(a + "o_proj.weight", (h, p), Cut.COLS, True),
        ]

    def mla_tensors(self) -> list[Tensor]:
        a, qk, h = "self_attn.", self.nope + self.rope, self.hidden
        fused = a + ("fused_qkv_a_g_proj.weight" if self.output_gate else "fused_qkv_a_proj.weight")
        found = [
            Tensor(a + "q_a_proj.weight", (self.q_lora, h), Cut.REPLICATE, True, fused),
            Tensor(
                a + "kv_a_proj_with_mqa.weight",
                (self.kv_lora + self.rope, h),
                Cut.REPLICATE,
                True,
                fused,
            ),
        ]
        if self.output_gate:
            found.append(
                Tensor(a + "g_proj.weight", (self.heads * self.v, h), Cut.ROWS, True, fused)
            )
        return [
            *found,
            Tensor(a + "q_a_layernorm.weight", (self.q_lora,), Cut.REPLICATE),
            Tensor(a + "q_b_proj.weight", (self.heads * qk, self.q_lora), Cut.ROWS, True),
            Tensor(a + "kv_a_layernorm.weight", (self.kv_lora,), Cut.REPLICATE),
            Tensor(
                a + "kv_b_proj.weight",
                (self.heads * (self.nope + self.v), self.kv_lora),
                Cut.ROWS,
                True,
            ),
            Tensor(a + "o_proj.weight", (h, self.heads * self.v), Cut.COLS, True),
        ]

    def moe_tensors(self) -> list[Tensor]:
        m, h = "block_sparse_moe.", self.hidden
        found = [
            Tensor(m + "gate.weight", (self.experts, h), Cut.REPLICATE),
            Tensor(m + "gate.e_score_correction_bias", (self.experts,), Cut.REPLICATE, dtype=F32),
        ]
        if self.shared:
            found += mlp_tensors(m + "shared_experts.", h, self.shared * self.moe_intermediate)
        if self.latent is not None:
            found.append(
                Tensor(m + "routed_expert_down_proj.weight", (self.latent, h), Cut.REPLICATE)
            )
            if self.latent_norm:
                found.append(Tensor(m + "routed_expert_norm.weight", (self.latent,), Cut.REPLICATE))
            found.append(
                Tensor(m + "routed_expert_up_proj.weight", (h, self.latent), Cut.REPLICATE)
            )
        return found

    def expert_width(self) -> int:
        return self.latent if self.latent is not None else self.hidden

    def expert_shapes(self, prefix: str) -> dict[str, tuple[int, int]]:
        width, inter = self.expert_width(), self.moe_intermediate
        shapes: dict[str, tuple[int, int]] = {}
        for e in range(self.experts):
            shapes[f"{prefix}{e}.w1.weight"] = (inter, width)
            shapes[f"{prefix}{e}.w3.weight"] = (inter, width)
            shapes[f"{prefix}{e}.w2.weight"] = (width, inter)
        return shapes

    def layer_tensors(self, layer: int) -> list[Tensor]:
        """Every tensor of one decoder layer but the routed experts, in vLLM's fusion order."""
        found = self.kda_tensors() if layer in self.kda_layers else self.mla_tensors()
        if self.is_moe(layer):
            found += self.moe_tensors()
        else:
            found += mlp_tensors("mlp.", self.hidden, self.intermediate)
        h = self.hidden
        found += [
            Tensor("input_layernorm.weight", (h,), Cut.REPLICATE),
            Tensor("post_attention_layernorm.weight", (h,), Cut.REPLICATE),
        ]
        if self.attn_res:
            found += [
                Tensor("self_attention_res_norm.weight", (h,), Cut.REPLICATE),
                Tensor("mlp_res_norm.weight", (h,), Cut.REPLICATE),
                Tensor("self_attention_res_proj.weight", (1, h), Cut.REPLICATE),
                Tensor("mlp_res_proj.weight", (1, h), Cut.REPLICATE),
            ]
        return found

    def sources(self) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """{Hugging Face name: (shape, fixed dtype)} of the text model."""
        found: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for layer in range(self.layers):
            prefix = f"{MODEL}layers.{layer}."
            for t in self.layer_tensors(layer):
                found[prefix + t.hf] = (
                    t.shape,
                    F32 if t.hf.endswith("e_score_correction_bias") else None,
                )
            if self.is_moe(layer):
                experts = self.expert_shapes(prefix + "block_sparse_moe.experts.")
                found |= {name: (shape, None) for name, shape in experts.items()}
        found[EMBED] = ((self.vocab, self.hidden), None)
        found[NORM] = ((self.hidden,), None)
        found[HEAD] = ((self.vocab, self.hidden), None)
        if self.attn_res:
            found[OUT_RES[0]] = ((self.hidden,), None)
            found[OUT_RES[1]] = ((1, self.hidden), None)
        return found

    def layer_params(self, layer: int) -> Iterator[tuple[str, Piece, str | None]]:
        """(vLLM name, piece, fixed dtype) in stacking order; pieces of one name fuse."""
        prefix = f"{MODEL}layers.{layer}."
        for t in self.layer_tensors(layer):
            yield prefix + t.vllm, Piece(prefix + t.hf, t.cut), t.dtype
            if t.hf == "self_attn.b_proj.weight":  # vLLM's `in_proj_padding`
                yield prefix + t.vllm, Piece(prefix + t.hf, Cut.ALIGN_ROWS, KDA_ALIGN), None
        if self.is_moe(layer):
            experts = f"{prefix}block_sparse_moe.experts."
            routed = experts + "routed_experts."
            gate_up = [
                (f"{experts}{e}.w1.weight", f"{experts}{e}.w3.weight") for e in range(self.experts)
            ]
            for piece in w13_pieces(gate_up):
                yield routed + "w13_weight", piece, None
            for piece in w2_pieces([f"{experts}{e}.w2.weight" for e in range(self.experts)]):
                yield routed + "w2_weight", piece, None


def text_config(config: Config) -> dict[str, Any]:
    """The text config brought to the top, as vLLM's `hf_text_config` reads it."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(
            "config.json of KimiK3ForConditionalGeneration has no text_config object; it is "
            "not a complete Kimi-K3 config"
        )
    found = {**config, **text}
    for key in TOP_KEYS:
        if key in config:
            found[key] = config[key]
    return found
