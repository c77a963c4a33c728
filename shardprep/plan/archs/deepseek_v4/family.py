"""DeepSeek-V4 (`DeepseekV4ForCausalLM`), from a bfloat16 checkpoint in the published
native naming (`embed.weight`, `layers.N.attn.*`, `layers.N.ffn.*`, `hc_*`, `head.weight`).

vLLM (`models/deepseek_v4/`, the CPU build's `cpu/model.py`) renames the checkpoint with
its weights mapper (`layers.` -> `model.layers.`, `embed.weight` ->
`model.embed_tokens.weight`, `head.weight` -> `lm_head.weight`, `hc_head*` ->
`model.hc_head*`, `ffn.gate.bias` -> `ffn.gate.e_score_correction_bias`,
`shared_experts.w2` -> `shared_experts.down_proj`) and its `load_weights` does the rest:

- attention: `wq_a` and `wkv` fused, in that order, into a replicated `fused_wqa_wkv`;
  `wq_b` (column-parallel) and `wo_a` (column-parallel over the output groups) split by
  rows, `wo_b` by columns; `q_norm`, `kv_norm` replicated; `attn_sink` (float32, one per
  head) split by heads;
- each layer with a compress ratio above 1 (`compress_ratios`) has a compressor: `wkv` and
  `wgate` fused into a replicated `fused_wkv_wgate`, `ape` (float32) and `norm`
  replicated; a layer of ratio 4 also has an indexer, never split: `wq_b`,
  `weights_proj` and its own compressor, as above;
- the hyper-connections (`hc_attn_*`, `hc_ffn_*` of each layer, `hc_head_*` of the model)
  are float32 and replicated; `hc_head_*` is built on every pipeline stage;
- the MoE: the router `gate` replicated in the model's dtype, with its float32
  `e_score_correction_bias` (from `gate.bias`), or, in the first `num_hash_layers`
  layers, the int32 hash table `gate.tid2eid` [vocab, experts per token] instead; routed
  experts `w1`/`w3`/`w2` stacked as FusedMoE's `w13_weight`/`w2_weight`; shared experts as
  a dense MLP (`w1`/`w3` fused into `gate_up_proj`, `w2` as `down_proj`);
- the embedding on the first stage, the final norm and `lm_head` on the last.

The checkpoint's `mtp.*` tensors hold the built-in DSpark draft (`dspark.py`),
which the target's `load_weights` drops. On NVIDIA GPUs vLLM builds `attn_sink` longer than
the rank's heads (`PADDED_AT_LOAD`); the loader fills the rank's heads first and leaves the
rest as vLLM initialized it, as vLLM's own loader does. The published fp8 + fp4 checkpoint
(`quantization_config` fp8 blocks with e8m0 `.scale` tensors, `expert_dtype: fp4`) is laid
out as vLLM's `DeepseekV4FP8Config` loads it: deepseek_v4_quant.py says which layers are
quantized, plan/quant/fp8_mxfp4.py how.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    BuiltinDraft,
    Config,
    Count,
    Family,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_count,
    config_int,
    expert_parallel_problems,
)
from shardprep.plan.archs.deepseek_v4.quant import quant_problem, quant_scheme, quantized_weights
from shardprep.plan.archs.parts.mla import F32, fused_params
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.experts import w2_pieces, w13_pieces
from shardprep.plan.quant import Scheme
from shardprep.plan.topology import Topology, pad_vocab

I32 = "I32"
# The model's hyper-connection head, built on every stage (`model.` + the source name)
HC_HEAD = ("hc_head_fn", "hc_head_base", "hc_head_scale")
# Parameters vLLM may build longer than the rank's share along dim 0 and fill only at the
# front (`attn_sink`: one -inf per padded head, `get_padded_num_q_heads`).
PADDED_AT_LOAD = re.compile(r"\.attn\.attn_sink$")


@dataclass(frozen=True)
class V4Dims:
    """The sizes config.json implies, under DeepSeek-V4's native config keys."""

    hidden: int
    heads: int
    head_dim: int
    q_lora: int
    o_lora: int
    o_groups: int
    index_heads: int
    index_head_dim: int
    moe_intermediate: int
    experts: int
    experts_per_token: int
    shared: int
    hash_layers: int
    hc_mult: int
    vocab: int
    layers: int
    ratios: tuple[int, ...]
    noaux_bias: bool

    @classmethod
    def of(cls, config: Config) -> V4Dims:
        layers = config_int(config, "num_hidden_layers")
        ratios = _native_ratios(config, layers)
        return cls(
            hidden=config_int(config, "hidden_size"),
            heads=config_int(config, "num_attention_heads"),
            head_dim=config_int(config, "head_dim"),
            q_lora=config_int(config, "q_lora_rank"),
            o_lora=config_int(config, "o_lora_rank"),
            o_groups=config_int(config, "o_groups"),
            index_heads=config_int(config, "index_n_heads"),
            index_head_dim=config_int(config, "index_head_dim"),
            moe_intermediate=config_int(config, "moe_intermediate_size"),
            experts=config_int(config, "n_routed_experts"),
            experts_per_token=config_int(config, "num_experts_per_tok"),
            shared=int(config.get("n_shared_experts") or 0),
            hash_layers=int(config["num_hash_layers"]),
            hc_mult=config_int(config, "hc_mult"),
            vocab=config_int(config, "vocab_size"),
            layers=layers,
            ratios=ratios,
            noaux_bias=config.get("topk_method") == "noaux_tc",
        )

    def ratio(self, layer: int) -> int:
        """vLLM's compress ratio of a layer (`max(1, compress_ratios[layer])`)."""
        return max(1, self.ratios[layer])


def _native_ratios(config: Config, layers: int) -> tuple[int, ...]:
    """`compress_ratios` of the layers, and `num_hash_layers` present: vLLM reads both
    under these native names only. transformers' own `DeepseekV4Config` saves them as
    `compress_rates` and `mlp_layer_types`, which vLLM's config class does not read."""
    missing = [key for key in ("compress_ratios", "num_hash_layers") if key not in config]
    if missing:
        raise ConfigError(
            f"config.json has no {' nor '.join(missing)}, which vLLM reads for DeepSeek-V4 "
            "(a config saved by transformers' DeepseekV4Config holds compress_rates and "
            "mlp_layer_types instead); use the checkpoint's native config.json"
        )
    ratios = config["compress_ratios"]
    if not isinstance(ratios, list) or len(ratios) < layers:
        raise ConfigError(
            f"config.json's compress_ratios is not a list of at least num_hidden_layers "
            f"({layers}) numbers; fix config.json"
        )
    return tuple(int(r) for r in ratios[:layers])


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor of a layer (suffix after `layers.N.`): its vLLM parameter
    (suffix after `model.layers.N.`), cut and fixed dtype."""

    source: str
    shape: tuple[int, ...]
    cut: Cut
    vllm: str = ""
    dtype: str | None = None


def compressor_tensors(prefix: str, ratio: int, head_dim: int, hidden: int) -> list[Tensor]:
    """A compressor (`DeepseekCompressor`): twice the width with overlap (ratio 4)."""
    width = (2 if ratio == 4 else 1) * head_dim
    fused = prefix + "fused_wkv_wgate.weight"
    return [
        Tensor(prefix + "wkv.weight", (width, hidden), Cut.REPLICATE, fused),
        Tensor(prefix + "wgate.weight", (width, hidden), Cut.REPLICATE, fused),
        Tensor(prefix + "ape", (ratio, width), Cut.REPLICATE, dtype=F32),
        Tensor(prefix + "norm.weight", (head_dim,), Cut.REPLICATE),
    ]


def attention_tensors(d: V4Dims, ratio: int) -> list[Tensor]:
    """A layer's attention, for its compress ratio (1: sliding window only)."""
    a, hd = "attn.", d.head_dim
    fused = a + "fused_wqa_wkv.weight"
    found = [
        Tensor(a + "wq_a.weight", (d.q_lora, d.hidden), Cut.REPLICATE, fused),
        Tensor(a + "wkv.weight", (hd, d.hidden), Cut.REPLICATE, fused),
        Tensor(a + "q_norm.weight", (d.q_lora,), Cut.REPLICATE),
        Tensor(a + "kv_norm.weight", (hd,), Cut.REPLICATE),
        Tensor(a + "wq_b.weight", (d.heads * hd, d.q_lora), Cut.ROWS),
        Tensor(a + "wo_a.weight", (d.o_groups * d.o_lora, d.heads * hd // d.o_groups), Cut.ROWS),
        Tensor(a + "wo_b.weight", (d.hidden, d.o_groups * d.o_lora), Cut.COLS),
        Tensor(a + "attn_sink", (d.heads,), Cut.ROWS, dtype=F32),
    ]
    if ratio > 1:
        found += compressor_tensors(a + "compressor.", ratio, hd, d.hidden)
    if ratio == 4:
        i, ihd = a + "indexer.", d.index_head_dim
        found += [
            Tensor(i + "wq_b.weight", (d.index_heads * ihd, d.q_lora), Cut.REPLICATE),
            Tensor(i + "weights_proj.weight", (d.index_heads, d.hidden), Cut.REPLICATE),
            *compressor_tensors(i + "compressor.", ratio, ihd, d.hidden),
        ]
    return found


def layer_tensors(d: V4Dims, layer: int) -> list[Tensor]:
    """Every tensor of one layer but the routed experts, in vLLM's fusion order."""
    return block_tensors(d, d.ratio(layer), hashed=layer < d.hash_layers)


def block_tensors(d: V4Dims, ratio: int, *, hashed: bool) -> list[Tensor]:
    """A decoder layer's tensors but the routed experts, for its compress ratio and
    whether it routes by token id (`hashed`)."""
    mix = (2 + d.hc_mult) * d.hc_mult
    hc = [
        Tensor(f"hc_{part}_{name}", shape, Cut.REPLICATE, dtype=F32)
        for part in ("attn", "ffn")
        for name, shape in (("fn", (mix, d.hc_mult * d.hidden)), ("base", (mix,)), ("scale", (3,)))
    ]
    norms = [Tensor(n + ".weight", (d.hidden,), Cut.REPLICATE) for n in ("attn_norm", "ffn_norm")]
    f = "ffn."
    ffn = [Tensor(f + "gate.weight", (d.experts, d.hidden), Cut.REPLICATE)]
    if hashed:
        table = (d.vocab, d.experts_per_token)
        ffn.append(Tensor(f + "gate.tid2eid", table, Cut.REPLICATE, dtype=I32))
    elif d.noaux_bias:
        bias = f + "gate.e_score_correction_bias"
        ffn.append(Tensor(f + "gate.bias", (d.experts,), Cut.REPLICATE, bias, F32))
    if d.shared:
        s, width = f + "shared_experts.", d.moe_intermediate * d.shared
        gate_up = s + "gate_up_proj.weight"
        ffn += [
            Tensor(s + "w1.weight", (width, d.hidden), Cut.ROWS, gate_up),
            Tensor(s + "w3.weight", (width, d.hidden), Cut.ROWS, gate_up),
            Tensor(s + "w2.weight", (d.hidden, width), Cut.COLS, s + "down_proj.weight"),
        ]
    return [*attention_tensors(d, ratio), *norms, *hc, *ffn]


def expert_shapes(d: V4Dims) -> dict[str, tuple[int, int]]:
    """The tensors of one routed expert, under `ffn.experts.{e}.`."""
    i, h = d.moe_intermediate, d.hidden
    return {"w1.weight": (i, h), "w3.weight": (i, h), "w2.weight": (h, i)}


class DeepseekV4Family(Family):
    name = "deepseek_v4"
    builtin_draft = BuiltinDraft(
        "dspark",
        held="a tensor of the DSpark draft, written to the draft's files",
        left_out="a tensor of the built-in DSpark draft (mtp.*), which vLLM's target does not "
        "load; --no-mtp or config.json without dspark_target_layer_ids leaves it out",
    )
    # With a draft at pp > 1, vLLM's NVIDIA target builds and loads the embedding on the
    # last stage too, for the draft to share (`spec_decode_needs_target_embed`).
    draft_embedding = "model.embed_tokens.weight"
    expert_parallel_refusal = "expert parallelism is not supported for DeepSeek-V4 yet"
    # As published: fp8 blocks with e8m0 scales and MXFP4 experts (quant.py)
    quant_schemes = frozenset({"fp8_block"})
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "DeepSeek-V4 is converted unquantized or as published (fp8 blocks, fp4 experts)"
    }

    def dims(self, config: Config) -> V4Dims:
        return V4Dims.of(config)

    def _sources(self, config: Config) -> dict[str, tuple[tuple[int, ...], str | None]]:
        d = self.dims(config)
        found: dict[str, tuple[tuple[int, ...], str | None]] = {
            "embed.weight": ((d.vocab, d.hidden), None),
            "norm.weight": ((d.hidden,), None),
            "head.weight": ((d.vocab, d.hidden), None),
            "hc_head_fn": ((d.hc_mult, d.hc_mult * d.hidden), F32),
            "hc_head_base": ((d.hc_mult,), F32),
            "hc_head_scale": ((1,), F32),
        }
        for layer in range(d.layers):
            prefix = f"layers.{layer}."
            found |= {prefix + t.source: (t.shape, t.dtype) for t in layer_tensors(d, layer)}
            for e in range(d.experts):
                for suffix, shape in expert_shapes(d).items():
                    found[f"{prefix}ffn.experts.{e}.{suffix}"] = (shape, None)
        return found

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The routed experts of every layer, three tensors each."""
        for key in ("n_shared_experts", "num_hash_layers"):
            config_count(config, key)
        d = self.dims(config)
        return [Count("n_routed_experts", d.experts, 3 * d.experts * d.layers)]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._sources(config).items()}

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """The float32 tensors (hyper-connections, sinks, `ape`, routing bias) and the
        int32 hash tables."""
        return {name: dtype for name, (_, dtype) in self._sources(config).items() if dtype}

    def index_ranges(self, config: Config) -> dict[str, tuple[int, int]]:
        d = self.dims(config)
        return {
            f"layers.{layer}.ffn.gate.tid2eid": (0, d.experts)
            for layer in range(min(d.hash_layers, d.layers))
        }

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        try:
            d = self.dims(config)
        except (KeyError, ValueError, TypeError):
            return []  # expected_shapes reports what config.json lacks
        problems = [quant_problem(config)] if config.get("quantization_config") else []
        problems = [p for p in problems if p]
        if config.get("tie_word_embeddings"):
            problems.append("tie_word_embeddings is not supported for DeepSeek-V4")
        problems += expert_parallel_problems(self, ctx)
        sizes = [
            ("num_attention_heads", d.heads),
            ("o_groups", d.o_groups),
            ("n_routed_experts", d.experts),
            ("moe_intermediate_size", d.moe_intermediate),
            ("moe_intermediate_size x n_shared_experts", d.moe_intermediate * d.shared),
            ("the vocabulary padded to 64", pad_vocab(d.vocab)),
        ]
        return problems + [
            f"{what} ({size}) is not divisible by tp={tp}; choose a tp that divides it"
            for what, size in sizes
            if size % tp
        ]

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        d = self.dims(config)
        own = [{t.source for t in layer_tensors(d, layer)} for layer in range(d.layers)]
        return quantized_weights(own, d.experts)

    def quant_scheme(self, scheme: Scheme) -> Scheme:
        return quant_scheme(scheme)

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        return [name for name in shapes if name.startswith("mtp.")]

    def internal_draft(self, config: Config) -> str | None:
        """The `mtp.*` stages are a DSpark draft when config.json names the target layers
        it reads (`dspark_target_layer_ids`); vLLM serves them with method `dspark`."""
        if not config.get("dspark_target_layer_ids"):
            return None
        try:
            self.dims(config)
        except ConfigError:
            return None  # the target's own planning names what config.json lacks
        return "dspark"

    def padded_at_load(self, name: str) -> bool:
        return PADDED_AT_LOAD.search(name) is not None

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d = self.dims(config)
        last = topology.last_stage
        params: list[Param] = []
        for layer in range(d.layers):
            stage = topology.stage_of_layer(layer)
            tensors = layer_tensors(d, layer)
            entries = block_params(d, tensors, f"layers.{layer}.", f"model.layers.{layer}.")
            params += fused_params(entries, stage)
        every = tuple(range(topology.pp))
        params += [
            Param("model.embed_tokens.weight", (Piece("embed.weight", Cut.VOCAB),), (0,)),
            Param("model.norm.weight", (Piece("norm.weight", Cut.REPLICATE),), (last,)),
            Param("lm_head.weight", (Piece("head.weight", Cut.VOCAB),), (last,)),
            *(Param("model." + n, (Piece(n, Cut.REPLICATE),), every, F32) for n in HC_HEAD),
        ]
        return Layout(tuple(params), num_experts=d.experts)


def block_params(
    d: V4Dims, tensors: list[Tensor], source: str, prefix: str
) -> Iterator[tuple[str, Piece, str | None]]:
    """(vLLM name, piece, fixed dtype) of one decoder layer whose checkpoint tensors sit
    under `source` and whose parameters under `prefix`, in stacking order; pieces of one
    name fuse."""
    for t in tensors:
        yield prefix + (t.vllm or t.source), Piece(source + t.source, t.cut), t.dtype
    experts, routed = f"{source}ffn.experts.", f"{prefix}ffn.experts.routed_experts."
    gate_up = [(f"{experts}{e}.w1.weight", f"{experts}{e}.w3.weight") for e in range(d.experts)]
    for piece in w13_pieces(gate_up):
        yield routed + "w13_weight", piece, None
    for piece in w2_pieces([f"{experts}{e}.w2.weight" for e in range(d.experts)]):
        yield routed + "w2_weight", piece, None
