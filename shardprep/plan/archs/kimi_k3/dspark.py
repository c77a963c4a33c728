"""Kimi-K3's DSpark draft (`K3DSparkModel`, as `Inferact/Kimi-K3-DSpark` publishes it):
vLLM's `K3DSparkForCausalLM` (`models/kimi_k3/nvidia/dspark_mla.py`), served with the
speculative method `dspark` from a folder of its own.

Five dense MLA layers (no output gate, no KDA, no experts), named `layers.{i}.*` in the
checkpoint and `model.layers.{i}.*` in vLLM (the local index; only the attention's
prefix is offset by the target's layer count). vLLM's `load_weights` maps every name
through `hf_to_vllm_mapper` (prefix `model.`; `q_a_proj` and `kv_a_proj_with_mqa` stacked
into `fused_qkv_a_proj`, `gate_proj` and `up_proj` into `gate_up_proj`; any name holding
`embed_tokens` or `lm_head` dropped, and `confidence_head` too unless the config enables
the head) after `_duplicate_context_kv_weights`, which feeds each layer's
`kv_a_proj_with_mqa` a second time, as shard i of the replicated
`model.context_kv_proj.weight`. So on the last stage, on every tp rank:

- `fused_qkv_a_proj` = [q_a_proj; kv_a_proj_with_mqa], whole; `q_a_layernorm`,
  `kv_a_layernorm`, both layernorms whole; `q_b_proj`, `kv_b_proj` by rows (whole
  heads), `o_proj` by columns; `gate_up_proj` = [gate rows of t; up rows of t],
  `down_proj` by columns;
- `context_kv_proj` = every layer's `kv_a_proj_with_mqa` stacked in layer order, whole;
- `context_proj` [H, target_hidden x num_target_layers], `context_norm`, `final_norm`
  and `markov_head.markov_w1` whole; `markov_head.markov_w2` padded to 64 rows, not
  split; with `enable_confidence_head` the confidence head `proj` (weight and bias)
  whole in float32, else dropped;
- no embedding and no lm_head: the draft builds none (`embed_tokens = lm_head = None`)
  and vLLM aliases the target's after loading. At pp > 1 the target then builds and
  loads its embedding on the last stage too (`spec_decode_needs_target_embed`), which
  the planner writes there (`shares_target_embedding`, `Family.draft_embedding`).

`load_weights` derives nothing but `context_kv_proj` (a parameter, in the rank files);
`_build_fused_context_kv_metadata` runs in `process_weights_after_loading`, after the
state the rank files hold. vLLM's CPU build constructs the draft (its kernels are chosen
at run time), so `tests/vllm/test_vllm_kimi_k3_dspark.py` compares the rank files with
vLLM's own state there; the `-dspark` cases of `tests/gpu/test_gpu_kimi_k3.py` do it on
a GPU (`pytest tests/gpu -m gpu`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    DraftFamily,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_int,
)
from shardprep.plan.archs.parts.mla import F32, Tensor, fused_params, mla_sizes, mlp_tensors
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

ARCHITECTURE = "K3DSparkModel"
MODEL_TYPE = "k3_dspark"
LAYER = re.compile(r"^layers\.(\d+)\.")
CONTEXT_KV = "model.context_kv_proj.weight"
CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
DROPPED = ("embed_tokens.weight", "lm_head.weight")  # vLLM's mapper drops both
SHARED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
# K3DSparkConfig's refusals: flags it does not build (it raises when any is true).
UNSUPPORTED_FLAGS = (
    "mla_use_nope",
    "mla_use_output_gate",
    "mla_use_qk_norm",
    "dspark_bonus_anchor",
)


@dataclass(frozen=True)
class DraftDims:
    """The draft's sizes, as vLLM's `K3DSparkConfig` reads them."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    vocab: int
    markov_rank: int
    target_hidden: int
    target_layer_ids: tuple[int, ...]
    confidence: bool
    confidence_with_markov: bool

    @classmethod
    def of(cls, config: Config) -> DraftDims:
        ids = config.get("target_layer_ids")
        return cls(
            hidden=config_int(config, "hidden_size"),
            intermediate=config_int(config, "intermediate_size"),
            layers=config_int(config, "num_hidden_layers"),
            heads=config_int(config, "num_attention_heads"),
            **mla_sizes(config),
            vocab=config_int(config, "vocab_size"),
            markov_rank=config_int(config, "markov_rank"),
            target_hidden=config_int(config, "target_hidden_size"),
            target_layer_ids=tuple(int(i) for i in ids) if isinstance(ids, list) else (),
            confidence=bool(config.get("enable_confidence_head", False)),
            confidence_with_markov=bool(config.get("confidence_head_with_markov", False)),
        )

    def layer_tensors(self) -> list[Tensor]:
        """One decoder layer's tensors, in vLLM's stacking order; pieces of one name fuse."""
        a, h, qk = "self_attn.", self.hidden, self.nope + self.rope
        fused = a + "fused_qkv_a_proj.weight"
        return [
            Tensor(a + "q_a_proj.weight", (self.q_lora, h), Cut.REPLICATE, True, fused),
            Tensor(
                a + "kv_a_proj_with_mqa.weight",
                (self.kv_lora + self.rope, h),
                Cut.REPLICATE,
                True,
                fused,
            ),
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
            *mlp_tensors("mlp.", h, self.intermediate),
            Tensor("input_layernorm.weight", (h,), Cut.REPLICATE),
            Tensor("post_attention_layernorm.weight", (h,), Cut.REPLICATE),
        ]

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model-level tensors besides the layers (config.json's confidence head too)."""
        h = self.hidden
        found: dict[str, tuple[int, ...]] = {
            "context_proj.weight": (h, self.target_hidden * len(self.target_layer_ids)),
            "context_norm.weight": (h,),
            "final_norm.weight": (h,),
            MARKOV[0]: (self.vocab, self.markov_rank),
            MARKOV[1]: (self.vocab, self.markov_rank),
        }
        if self.confidence:
            width = h + (self.markov_rank if self.confidence_with_markov else 0)
            found |= {CONFIDENCE[0]: (1, width), CONFIDENCE[1]: (1,)}
        return found


def config_problems(config: Config, target: Config) -> list[str]:
    """What `K3DSparkConfig` raises on, and a draft that does not fit its target."""
    problems = [
        f"config.json sets {flag}, which vLLM's Kimi-K3 DSpark draft does not build (its "
        "config class refuses it); use a draft trained without it"
        for flag in UNSUPPORTED_FLAGS
        if config.get(flag)
    ]
    if config.get("q_lora_rank") is None:
        problems.append(
            "config.json has no q_lora_rank; vLLM's Kimi-K3 DSpark draft needs the low-rank "
            "query (its config class refuses q_lora_rank=None)"
        )
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != vocab:
        problems.append(
            f"draft_vocab_size ({draft_vocab}) differs from vocab_size ({vocab}); vLLM's "
            "Kimi-K3 DSpark draft shares the target's embedding and lm_head and refuses it"
        )
    ids = config.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or config.get("num_target_layers") != len(ids):
        problems.append(
            "config.json needs a non-empty target_layer_ids list and num_target_layers equal "
            "to its length (vLLM's Kimi-K3 DSpark config refuses anything else); fix config.json"
        )
    layers = target.get("num_hidden_layers")
    if isinstance(ids, list) and isinstance(layers, int):
        beyond = [i for i in ids if not (isinstance(i, int) and 0 <= i < layers)]
        if beyond:
            problems.append(
                f"its target_layer_ids {beyond} name layers the target does not have "
                f"({layers} layers); pair the draft with the target it was trained for"
            )
    for key, target_key in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        mine, theirs = config.get(key), target.get(target_key)
        if theirs is not None and mine is not None and mine != theirs:
            problems.append(
                f"its {key} ({mine}) is not the target's {target_key} ({theirs}); vLLM feeds "
                "it the target's hidden states and shares its embedding and lm_head, so pair "
                "the draft with the target it was trained for"
            )
    return problems


class KimiK3DSparkDraft(DraftFamily):
    name = "kimi_k3_dspark"
    shares_target_embedding = True  # vLLM's `spec_decode_needs_target_embed`

    def recognizes(self, config: Config, names: list[str]) -> bool:
        archs = config.get("architectures") or []
        return ARCHITECTURE in archs or config.get("model_type") == MODEL_TYPE

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        if not self.recognizes(config, []):
            raise ConfigError(
                f"the draft's config.json names {config.get('architectures')} (model_type "
                f"{config.get('model_type')!r}), not {ARCHITECTURE}: a Kimi-K3 target takes "
                "only its own DSpark draft"
            )
        d = DraftDims.of(config)
        shapes = {f"layers.{i}.{t.hf}": t.shape for i in range(d.layers) for t in d.layer_tensors()}
        shapes |= d.head_shapes()
        shapes |= {name: (d.vocab, d.hidden) for name in DROPPED}
        if not d.confidence:  # vLLM drops a confidence head it does not build
            width = d.hidden + (d.markov_rank if d.confidence_with_markov else 0)
            shapes |= {CONFIDENCE[0]: (1, width), CONFIDENCE[1]: (1,)}
        return shapes

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        problems = config_problems(config, ctx.target_config or {})
        try:
            d = DraftDims.of(config)
        except ConfigError as exc:
            return [*problems, str(exc)]
        for what, size in (("num_attention_heads", d.heads), ("intermediate_size", d.intermediate)):
            if size % tp:
                problems.append(
                    f"its {what} ({size}) is not divisible by tp={tp}; vLLM splits the draft "
                    "like the target, so choose a tp that divides it"
                )
        names = ctx.draft_names or ()
        beyond = sorted(
            {int(m[1]) for n in names if (m := LAYER.match(n)) and int(m[1]) >= d.layers}
        )
        if beyond:
            problems.append(
                f"the checkpoint holds layers {beyond} but config.json's num_hidden_layers is "
                f"{d.layers}, and vLLM fails on the others; fix num_hidden_layers"
            )
        return problems

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d, last = DraftDims.of(config), topology.last_stage
        params: list[Param] = []
        for i in range(d.layers):
            prefix = f"layers.{i}."
            entries = (
                (f"model.{prefix}{t.vllm}", Piece(prefix + t.hf, t.cut), t.dtype)
                for t in d.layer_tensors()
            )
            params += fused_params(entries, last)
        kv = tuple(
            Piece(f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight", Cut.REPLICATE)
            for i in range(d.layers)
        )
        params.append(Param(CONTEXT_KV, kv, (last,)))
        for name in d.head_shapes():
            cut = Cut.PADDED_VOCAB if name == MARKOV[1] else Cut.REPLICATE
            dtype = F32 if name in CONFIDENCE else None
            params.append(Param(f"model.{name}", (Piece(name, cut),), (last,), dtype))
        skipped = {
            name: "vLLM's Kimi-K3 DSpark loader drops it and uses the target's"
            for name in DROPPED
            if name in shapes
        }
        if not d.confidence:
            skipped |= {
                name: "config.json does not enable the confidence head, so vLLM builds none "
                "and its loader drops it"
                for name in CONFIDENCE
                if name in shapes
            }
        optional = set(DROPPED) | (set() if d.confidence else set(CONFIDENCE))
        return Layout(
            tuple(params),
            skipped,
            shared_with_target=SHARED,
            optional_sources=frozenset(optional),
        )
