"""DeepSeek-V4's built-in DSpark draft (vLLM's `DSparkDraftModel`,
`models/deepseek_v4/nvidia/dspark.py`: `DSparkDeepseekV4ForCausalLM`).

The draft's tensors are in the target checkpoint, under `mtp.{i}.` for its stages
i < n (`n_mtp_layers`, 3 when config.json names none); vLLM serves it with the speculative
method `dspark`, with the target's config. Its `load_weights` keeps only `mtp.*` names:

- `mtp.{i}.<rest>` is decoder layer `model.layers.{i}.<rest>` (the local index; the
  layer's attention prefix is `layers.{L+i}`, L = num_hidden_layers, so its compress
  ratio is 1: no compressor, no indexer, and it routes by token id only below
  `num_hash_layers`), renamed as the target's (`wq_a`/`wkv` fused into `fused_wqa_wkv`,
  shared `w1`/`w3` into `gate_up_proj`, `w2` as `down_proj`, `gate.bias` as
  `e_score_correction_bias`, `attn_sink` narrowed to the rank's heads) and cut as the
  target's layers; routed experts stacked as FusedMoE's;
- every stage's `attn.wkv.weight` is also stacked, stage by stage, into the replicated
  `model.context_wkv_proj.weight` (`_duplicate_context_wkv_weights`, shard i);
- `main_proj`, `main_norm` and the head stack (`norm`, the float32 `hc_head_*`,
  `markov_head.*`, `confidence_head.*`) sit at model level (`model.<rest>`) whichever
  stage carries them (the published checkpoints: `mtp.0.main_*`, the heads in the last
  stage); all replicated; `markov_w2` padded to 64 rows, not split; the confidence head
  (no bias) float32, and dropped (`confidence_head = None`) when the checkpoint has none;
- the embedding and lm_head are never loaded: vLLM aliases the target's
  (`has_own_embed_tokens = has_own_lm_head = False`).

vLLM's CPU build has no DSpark model for DeepSeek-V4 (its class raises when built), so
these rules are tested on bytes (`tests/plan/archs/deepseek_v4/test_deepseek_v4_dspark.py`)
and against a GPU vLLM by `tests/gpu/test_gpu_deepseek_v4.py` (`pytest tests/gpu -m gpu`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Count,
    DraftFamily,
    Layout,
    Param,
    PlanContext,
    Shapes,
    config_int,
)
from shardprep.plan.archs.deepseek_v4.family import (
    HC_HEAD,
    PADDED_AT_LOAD,
    DeepseekV4Family,
    V4Dims,
    block_params,
    block_tensors,
    expert_shapes,
)
from shardprep.plan.archs.parts.mla import F32, fused_params
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
DEFAULT_STAGES = 3  # vLLM's `n_mtp_layers or 3`
MAIN = ("main_proj.weight", "main_norm.weight")
MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
CONFIDENCE = "confidence_head.proj.weight"
CONFIDENCE_BIAS = "confidence_head.proj.bias"
CONTEXT_WKV = "model.context_wkv_proj.weight"
SHARED = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def num_stages(config: Config) -> int:
    return config_int(config, "n_mtp_layers", DEFAULT_STAGES)


def confidence_enabled(config: Config) -> bool:
    """vLLM builds the confidence head unless config.json turns it off."""
    return bool(config.get("enable_confidence_head", True))


def head_shapes(d: V4Dims, config: Config) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """The model-level tensors (suffix after `mtp.{i}.`), with their fixed source dtype."""
    rank = config_int(config, "dspark_markov_rank")
    layers = config.get("dspark_target_layer_ids")
    if not isinstance(layers, list) or not layers:
        raise ConfigError(
            "config.json's dspark_target_layer_ids is not a non-empty list of layer ids, "
            "which vLLM's DSpark draft reads; fix config.json"
        )
    found: dict[str, tuple[tuple[int, ...], str | None]] = {
        "main_proj.weight": ((d.hidden, d.hidden * len(layers)), None),
        "main_norm.weight": ((d.hidden,), None),
        "norm.weight": ((d.hidden,), None),
        "hc_head_fn": ((d.hc_mult, d.hc_mult * d.hidden), F32),
        "hc_head_base": ((d.hc_mult,), F32),
        "hc_head_scale": ((1,), F32),
        MARKOV[0]: ((d.vocab, rank), None),
        MARKOV[1]: ((d.vocab, rank), None),
    }
    if confidence_enabled(config):
        found[CONFIDENCE] = ((1, d.hidden + rank), None)
    return found


def head_stages(config: Config, names: Sequence[str] | None) -> dict[str, int]:
    """The stage whose `mtp.{i}.` carries each model-level tensor: the one the checkpoint
    has (`names`), else `main_*` in stage 0 and the heads in the last stage."""
    n, found = num_stages(config), {}
    held: dict[str, set[int]] = {}
    for name in names or ():
        match = STAGE.match(name)
        if match:
            held.setdefault(match[2], set()).add(int(match[1]))
    for rest in (*MAIN, "norm.weight", *HC_HEAD, *MARKOV, CONFIDENCE):
        stages = held.get(rest, set())
        if len(stages) > 1:
            raise ConfigError(
                f"the checkpoint holds {rest} in DSpark stages {sorted(stages)}; vLLM loads "
                "every copy into one parameter, so which one it keeps depends on the file "
                "order: keep it in one stage"
            )
        found[rest] = next(iter(stages)) if stages else (0 if rest in MAIN else n - 1)
    return found


class DeepseekV4DSparkDraft(DraftFamily):
    name = "deepseek_v4_dspark"
    shares_target_embedding = True  # vLLM's `spec_decode_needs_target_embed`
    standalone = False  # it comes inside its target, never with --draft
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "the DSpark stages (mtp.*) of a quantized DeepSeek-V4 are not laid out yet "
        "(convert the target alone with --no-mtp)"
    }

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The target's counts, and the DSpark stages, each a block with its own experts."""
        counted = DeepseekV4Family().counts(config)
        stages, experts = num_stages(config), counted[0].value
        return [*counted, Count("n_mtp_layers", stages, stages * (1 + 3 * experts))]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._sources(config, ctx).items()}

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """The float32 tensors: hyper-connections, sinks, the routing bias."""
        return {name: dtype for name, (_, dtype) in self._sources(config).items() if dtype}

    def _sources(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
        d, names = V4Dims.of(config), ctx.draft_names
        if names is not None and not any(STAGE.match(n) for n in names):
            raise ConfigError(
                "config.json names DSpark target layers (dspark_target_layer_ids) but the "
                "checkpoint holds no mtp.* tensor of the draft; convert with --no-mtp to "
                "leave the draft out"
            )
        found: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for i in range(num_stages(config)):
            prefix = f"mtp.{i}."
            for t in block_tensors(d, 1, hashed=d.layers + i < d.hash_layers):
                found[prefix + t.source] = (t.shape, t.dtype)
            for e in range(d.experts):
                for suffix, shape in expert_shapes(d).items():
                    found[f"{prefix}ffn.experts.{e}.{suffix}"] = (shape, None)
        stages = head_stages(config, names)
        for rest, entry in head_shapes(d, config).items():
            found[f"mtp.{stages[rest]}.{rest}"] = entry
        return found

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        """What vLLM's DSpark `load_weights` would fail on; the target's checks cover the
        sizes of the layers."""
        problems = []
        n, names = num_stages(config), ctx.draft_names or ()
        matches = [m for name in names if (m := STAGE.match(name))]
        held_rest = {m[2] for m in matches}
        beyond = sorted({int(m[1]) for m in matches if int(m[1]) >= n})
        if beyond:
            problems.append(
                f"the checkpoint holds DSpark stage(s) mtp.{beyond} but vLLM builds "
                f"n_mtp_layers={n} stage(s), and fails on the others; set n_mtp_layers in "
                "config.json to the stages the checkpoint holds"
            )
        if CONFIDENCE_BIAS in held_rest and confidence_enabled(config):
            problems.append(
                "the checkpoint's DSpark confidence head has a bias, which vLLM's DeepSeek-V4 "
                "DSpark draft does not build (its loader fails on it); use a checkpoint "
                "without confidence_head.proj.bias"
            )
        draft_vocab = config.get("draft_vocab_size")
        if draft_vocab is not None and int(draft_vocab) != int(config["vocab_size"]):
            problems.append(
                f"draft_vocab_size ({draft_vocab}) differs from vocab_size; vLLM then keeps "
                "the draft's own lm_head, which no DeepSeek-V4 checkpoint holds; remove "
                "draft_vocab_size from config.json"
            )
        return problems

    def padded_at_load(self, name: str) -> bool:
        return PADDED_AT_LOAD.search(name) is not None

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d, last = V4Dims.of(config), topology.last_stage
        n = num_stages(config)
        params: list[Param] = []
        for i in range(n):
            tensors = block_tensors(d, 1, hashed=d.layers + i < d.hash_layers)
            entries = block_params(d, tensors, f"mtp.{i}.", f"model.layers.{i}.")
            params += fused_params(entries, last)
        context_wkv = tuple(Piece(f"mtp.{i}.attn.wkv.weight", Cut.REPLICATE) for i in range(n))
        params.append(Param(CONTEXT_WKV, context_wkv, (last,)))
        stages = head_stages(config, sorted(shapes))
        for rest, (_, dtype) in head_shapes(d, config).items():
            cut = Cut.PADDED_VOCAB if rest == MARKOV[1] else Cut.REPLICATE
            fixed = F32 if rest == CONFIDENCE else dtype
            source = f"mtp.{stages[rest]}.{rest}"
            if rest == CONFIDENCE and source not in shapes:
                continue  # vLLM drops the confidence head when the checkpoint has none
            params.append(Param(f"model.{rest}", (Piece(source, cut),), (last,), fixed))
        used = {piece.source for param in params for piece in param.pieces}
        skipped = {name: "a tensor of the target" for name in shapes if name not in used}
        for name in skipped.keys() & {n for n in shapes if ".confidence_head." in n}:
            skipped[name] = (
                "config.json turns the confidence head off (enable_confidence_head), so vLLM "
                "builds none and skips it"
            )
        return Layout(
            tuple(params),
            skipped,
            shared_with_target=SHARED,
            optional_sources=frozenset({f"mtp.{stages[CONFIDENCE]}.{CONFIDENCE}"}),
            num_experts=d.experts,
        )

    # -- what vLLM's load_weights does besides copying ------------------------------------

    def before_fill(self, model: Any, names: set[str]) -> None:
        """vLLM sets `confidence_head = None` when the checkpoint has none."""
        if not any(n.startswith("model.confidence_head.") for n in names):
            model.model.confidence_head = None

    def after_fill(self, model: Any, filled: set[str]) -> None:
        """vLLM's `load_weights` ends with the model's own `process_weights_after_loading`
        (the MegaMoE experts' finalisation, a no-op otherwise)."""
        finish = getattr(model, "process_weights_after_loading", None)
        if callable(finish):
            finish()
