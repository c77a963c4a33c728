"""DFlash and DSpark drafts (vLLM's `qwen3_dflash.py` and `qwen3_dspark.py`), for targets
of the Llama family (Llama, Qwen3, ...).

A DFlash draft is a stack of Qwen3 layers (q/k norms always present) named
`layers.{i}` in its checkpoint and `model.layers.{i}` in vLLM (the local index: only
the attention prefix is offset by the target's layer count), a replicated `fc` over
the target's auxiliary hidden states, `hidden_norm` and `norm`; the embedding, lm_head
and `d2t` are optional (vLLM shares the target's embedding and lm_head when absent).
A separately trained mask embedding may ship as `mask_embedding.pt`; vLLM reads it
(when `mask_token_id` is configured) into `model.mask_embedding`, else leaves zeros.
With `dflash_config.attention_sink_bias` each layer has a sink bias per attention head,
split over the ranks like the heads.

DSpark adds a replicated Markov head (`markov_w1` an embedding, `markov_w2` a vocab
head padded to 64 but not split) and an optional float32 confidence head, which vLLM
drops (`confidence_head = None`) when the checkpoint has none.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    Layout,
    Param,
    PlanContext,
    Shapes,
)
from shardprep.plan.archs.parts.dense import Dims
from shardprep.plan.archs.parts.eagle import EagleBase, draft_dims
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

MASK_EMBEDDING_FILE = "mask_embedding.pt"
MASK_EMBEDDING = "mask_embedding"  # the source name shardprep gives the side file's tensor
CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
SINK_BIAS = "self_attn.attention_sink_bias"


def _drafter_config(config: Config) -> dict[str, Any]:
    """vLLM's precedence: `eagle_config` updated by `dflash_config`."""
    merged = dict(config.get("eagle_config") or {})
    merged.update(config.get("dflash_config") or {})
    return merged


def _aux_layer_ids(config: Config) -> list[int] | None:
    """The target layers whose states feed `fc`, as vLLM's
    `get_eagle3_aux_layers_from_config` finds them (zero-based DFlash ids, +1)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [i + 1 for i in (config.get("dflash_config") or {}).get("target_layer_ids") or []]
    if not ids:
        ids = [i + 1 for i in config.get("dspark_target_layer_ids") or []]
    if not ids:
        ids = [i + 1 for i in config.get("target_layer_ids") or []]
    if not ids:
        for key in ("dflash_config", "eagle_config"):
            ids = (config.get(key) or {}).get("layer_ids") or []
            if ids:
                break
    return list(ids) or None


def has_sink_bias(config: Config) -> bool:
    """vLLM's flag: `dflash_config.attention_sink_bias`, else `add_swa_attention_sink_bias`."""
    dflash = config.get("dflash_config") or {}
    return bool(dflash.get("attention_sink_bias", config.get("add_swa_attention_sink_bias")))


def mask_token_id(config: Config) -> int | None:
    value = _drafter_config(config).get("mask_token_id", config.get("mask_token_id"))
    return None if value is None else int(value)


class DFlashDraft(EagleBase):
    side_files: ClassVar[frozenset[str]] = frozenset({MASK_EMBEDDING_FILE})
    name = "dflash"
    layer_pattern = re.compile(r"^(?:midlayer|layers\.(\d+))\.(.+)$")
    top_level: ClassVar[dict[str, tuple[str, Cut]]] = {
        "embed_tokens.weight": ("model.embed_tokens.weight", Cut.VOCAB),
        "fc.weight": ("model.fc.weight", Cut.REPLICATE),
        "encoder.fc.weight": ("model.fc.weight", Cut.REPLICATE),
        "hidden_norm.weight": ("model.hidden_norm.weight", Cut.REPLICATE),
        "encoder.output_norm_enc.weight": ("model.hidden_norm.weight", Cut.REPLICATE),
        "norm.weight": ("model.norm.weight", Cut.REPLICATE),
        "lm_head.weight": ("lm_head.weight", Cut.VOCAB),
        "d2t": ("draft_id_to_target_id", Cut.REPLICATE),
        MASK_EMBEDDING: ("model.mask_embedding", Cut.REPLICATE),
    }
    skipped_names: ClassVar[dict[str, str]] = {"t2d": "vLLM does not use the target-to-draft table"}
    optional_sources: ClassVar[frozenset[str]] = frozenset(
        {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d", MASK_EMBEDDING}
    )
    # Parameters vLLM leaves at their initial value when the checkpoint lacks them.
    may_stay_unloaded: ClassVar[frozenset[str]] = frozenset(
        {"model.mask_embedding", "draft_id_to_target_id"}
    )

    def recognizes(self, config: Config, names: list[str]) -> bool:
        archs = config.get("architectures") or []
        if any("DSpark" in a for a in archs) or any(n.startswith("markov_head.") for n in names):
            return False
        return (
            "dflash_config" in config
            or any("DFlash" in a for a in archs)
            or ("hidden_norm.weight" in names and any(n.startswith("layers.") for n in names))
        )

    def example_tables(self, config: Config, *, target_config: Config, seed: int) -> dict:
        return {}

    # -- shapes ---------------------------------------------------------------------------

    @staticmethod
    def _draft_vocab(config: Config) -> int:
        return int(config.get("draft_vocab_size") or config["vocab_size"])

    @staticmethod
    def _uses_fc(config: Config) -> bool:
        drafter = _drafter_config(config)
        return bool(drafter.get("use_aux_hidden_state", config.get("use_aux_hidden_state", True)))

    def _fc_input(self, config: Config, target: Config, dims: Dims) -> int:
        aux = _aux_layer_ids(config)
        count = len(aux) if aux else dims.layers
        target_hidden = config.get("target_hidden_size") or target.get("hidden_size")
        return int(target_hidden or dims.hidden) * count

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        target = ctx.target_config
        dims = draft_dims(config, target)
        bias = bool(config.get("attention_bias", False))
        layer = dims.layer_shapes(bias, True, dims.hidden)
        if bias:
            layer["self_attn.o_proj.bias"] = (dims.hidden,)
        if has_sink_bias(config):
            layer[SINK_BIAS] = (dims.heads,)
        shapes = {
            f"layers.{i}.{s}": shape for i in range(dims.layers) for s, shape in layer.items()
        }
        draft_vocab = self._draft_vocab(config)
        shapes |= {
            "hidden_norm.weight": (dims.hidden,),
            "norm.weight": (dims.hidden,),
            "embed_tokens.weight": (dims.vocab, dims.hidden),
            "lm_head.weight": (draft_vocab, dims.hidden),
            "d2t": (draft_vocab,),
            "t2d": (dims.vocab,),
            MASK_EMBEDDING: (dims.hidden,),
        }
        if self._uses_fc(config):
            shapes["fc.weight"] = (dims.hidden, self._fc_input(config, target, dims))
        return shapes

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        target = ctx.target_config
        problems = super().check(config, tp, ctx)
        layers = int(target.get("num_hidden_layers") or 0)
        aux = _aux_layer_ids(config) or []
        beyond = [i - 1 for i in aux if not 0 < i <= layers]
        if layers and beyond:
            problems.append(
                f"its target_layer_ids {beyond} name layers the target does not have "
                f"({layers} layers); pair the draft with the target it was trained for"
            )
        names = ctx.draft_names or ()
        if not has_sink_bias(config) and any(n.endswith(SINK_BIAS) for n in names):
            problems.append(
                "it holds attention sink biases but its config.json does not enable them, so "
                "vLLM has no parameter for them; set dflash_config.attention_sink_bias to "
                "true, as the draft was trained"
            )
        return problems

    # -- layout ---------------------------------------------------------------------------

    def _keeps_d2t(self, config: Config, target_vocab: int | None) -> bool:
        return self._draft_vocab(config) != target_vocab

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        layout = super().layout(config, shapes, topology, ctx)
        params = layout.params + self._sink_params(config, shapes, topology)
        dropped: dict[str, str] = {}
        target_vocab = ctx.target_config.get("vocab_size")
        if "d2t" in shapes and not self._keeps_d2t(config, target_vocab):
            dropped["d2t"] = "vLLM builds no draft-to-target table for this vocabulary"
        if not self._uses_fc(config):
            for name in ("fc.weight", "encoder.fc.weight"):
                if name in shapes:
                    dropped[name] = "the draft does not use auxiliary hidden states"
        if MASK_EMBEDDING in shapes and not self._reads_mask_embedding(config):
            dropped[MASK_EMBEDDING] = "vLLM does not read a mask embedding for this draft"
        params = tuple(p for p in params if not {x.source for x in p.pieces} & set(dropped))
        return dataclasses.replace(layout, params=params, skipped={**layout.skipped, **dropped})

    def _sink_params(self, config: Config, shapes: Shapes, topology: Topology) -> tuple[Param, ...]:
        """One sink bias per head and layer: each rank holds its heads' (vLLM's
        `_preprocess` narrows it like the heads)."""
        if not has_sink_bias(config):
            return ()
        params = []
        for name in shapes:
            match = self.layer_pattern.match(name)
            if match and match.group(2) == SINK_BIAS:
                vllm_name = f"model.layers.{int(match.group(1) or 0)}.{SINK_BIAS}"
                params.append(Param(vllm_name, (Piece(name, Cut.ROWS),), (topology.last_stage,)))
        return tuple(params)

    def _reads_mask_embedding(self, config: Config) -> bool:
        """vLLM's DFlash reads `mask_embedding.pt` only when a mask token is configured."""
        return mask_token_id(config) is not None

    # -- the side file --------------------------------------------------------------------

    def side_tensor_files(self, config: Config) -> dict[str, str]:
        return {MASK_EMBEDDING: MASK_EMBEDDING_FILE} if self._reads_mask_embedding(config) else {}

    def side_tensor(self, name: str, state: Any, config: Config, where: str) -> Any:
        """The mask embedding from `mask_embedding.pt`: a tensor, or a dict holding it
        under 'embedding' with the draft's `mask_token_id`."""
        import torch

        token = mask_token_id(config)
        if isinstance(state, dict):
            if state.get("mask_token_id", token) != token:
                raise ConfigError(
                    f"{where} is for mask_token_id {state.get('mask_token_id')} but the draft's "
                    f"config.json says {token}; use the file that came with this draft"
                )
            state = state.get("embedding")
        if not isinstance(state, torch.Tensor) or not state.is_floating_point():
            raise ConfigError(
                f"{where} holds no floating-point tensor (nor a dict with 'embedding'); "
                "use the file that came with this draft"
            )
        return state.reshape(-1).contiguous()

    # -- what vLLM's load_weights does besides copying ------------------------------------

    def before_fill(self, model: Any, names: set[str]) -> None:
        """Nothing to drop for DFlash (DSpark drops an absent confidence head)."""

    def after_fill(self, model: Any, filled: set[str]) -> None:
        """vLLM's `load_weights` ends by stacking the KV projections of every layer for
        its fused context pass, and flags the mask embedding it read."""
        super().after_fill(model, filled)
        if "model.mask_embedding" in filled:  # only there when vLLM would have read it
            model.model.has_separate_mask_embedding = True
        model.model._build_fused_kv_buffers()


class DSparkDraft(DFlashDraft):
    name = "dspark"
    top_level: ClassVar[dict[str, tuple[str, Cut]]] = {
        **DFlashDraft.top_level,
        "markov_head.markov_w1.weight": ("model.markov_head.markov_w1.weight", Cut.REPLICATE),
        "markov_head.markov_w2.weight": ("model.markov_head.markov_w2.weight", Cut.PADDED_VOCAB),
        **{n: (f"model.{n}", Cut.REPLICATE) for n in CONFIDENCE},
    }
    optional_sources: ClassVar[frozenset[str]] = DFlashDraft.optional_sources | set(CONFIDENCE)

    def recognizes(self, config: Config, names: list[str]) -> bool:
        archs = config.get("architectures") or []
        return any("DSpark" in a for a in archs) or any(n.startswith("markov_head.") for n in names)

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes(config, ctx)
        dims = draft_dims(config, ctx.target_config)
        rank = int(config["markov_rank"])
        shapes["markov_head.markov_w1.weight"] = (dims.vocab, rank)
        shapes["markov_head.markov_w2.weight"] = (self._draft_vocab(config), rank)
        if config.get("enable_confidence_head"):
            width = dims.hidden + (rank if config.get("confidence_head_with_markov") else 0)
            shapes |= {CONFIDENCE[0]: (1, width), CONFIDENCE[1]: (1,)}
        return shapes

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        problems = super().check(config, tp, ctx)
        target_vocab = int(ctx.target_config.get("vocab_size") or 0)
        names = set(ctx.draft_names or ())
        if target_vocab and self._draft_vocab(config) < target_vocab and names:
            lacking = [n for n in ("lm_head.weight", "d2t") if n not in names]
            if lacking:
                problems.append(
                    f"its vocabulary ({self._draft_vocab(config)}) is smaller than the "
                    f"target's ({target_vocab}) but it lacks {', '.join(lacking)}, which vLLM "
                    "requires then; use the complete draft checkpoint"
                )
        return problems

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        layout = super().layout(config, shapes, topology, ctx)
        # The confidence head stays float32 whatever the model's dtype.
        float32 = {f"model.{n}" for n in CONFIDENCE}
        params = tuple(
            dataclasses.replace(p, dtype="F32") if p.name in float32 else p for p in layout.params
        )
        skipped = dict(layout.skipped)
        if not config.get("enable_confidence_head"):
            # vLLM builds no confidence head then, and its loader drops the tensors.
            dropped = {
                n: "the draft config does not enable the confidence head" for n in CONFIDENCE
            }
            dropped = {n: why for n, why in dropped.items() if n in shapes}
            params = tuple(p for p in params if p.pieces[0].source not in dropped)
            skipped = {**layout.skipped, **dropped}
        return dataclasses.replace(layout, params=params, skipped=skipped)

    def _keeps_d2t(self, config: Config, target_vocab: int | None) -> bool:
        return target_vocab is not None and self._draft_vocab(config) < target_vocab

    def _reads_mask_embedding(self, config: Config) -> bool:
        return False  # DSpark masks through the vocabulary row; the parameter stays zero

    def before_fill(self, model: Any, names: set[str]) -> None:
        """vLLM sets `confidence_head = None` when the checkpoint has none."""
        if not any(n.startswith("model.confidence_head.") for n in names):
            model.model.confidence_head = None
