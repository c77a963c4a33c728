"""Kimi-K3's multi-token prediction (MTP) draft (vLLM's `KimiK3MTP`,
`models/kimi_k3/nvidia/mtp.py`, served as `KimiK3MTPModel` with the method `mtp`).

The draft lives inside the target checkpoint: text layers L .. L+n-1 (L =
num_hidden_layers, n = num_nextn_predict_layers), under `language_model.model.layers.`.
Each is a `KimiDecoderLayer` built for layer index L+i (so KDA or MLA, MoE or dense by
the target's rules for that index) but without attention residuals, plus `enorm`,
`hnorm`, `eh_proj` (a replicated linear layer, never quantized), `shared_head.norm`,
`shared_head.head` (a vocab head) and a copy of the embedding. `load_weights` drops the
`language_model.` prefix, keeps only names of the MTP layers, puts the decoder layer's
tensors under `model.layers.{L+i}.mtp_block.`, keeps the other names, and loads
`model.embed_tokens` from the first MTP layer's `embed_tokens` only (never from the
target's embedding); the layer's attention-residual tensors, if any, have no parameter.

After loading, vLLM's proposer replaces every `shared_head.head` with the target's
lm_head at any pp, and at pp = 1 the embedding with the target's (`_maybe_share_lm_head`,
`_maybe_share_embeddings`): copies equal to those are not written. At pp > 1 the draft,
on the last stage, keeps its own embedding, which only the first MTP layer's copy fills.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
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
)
from shardprep.plan.archs.kimi_k3.family import KimiK3Family
from shardprep.plan.archs.kimi_k3.quant import quantized_weights
from shardprep.plan.archs.kimi_k3.text import EMBED, HEAD, MODEL, K3Dims, text_config
from shardprep.plan.archs.parts.mla import F32, fused_params
from shardprep.plan.archs.parts.mtp import mtp_layers, require_mtp_layer
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

BLOCK = "mtp_block."
DRAFT_EMBED = "model.embed_tokens.weight"
NORMS = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")
EH_PROJ = "eh_proj.weight"
LAYER_HEAD = "shared_head.head.weight"
LAYER_EMBED = "embed_tokens.weight"
LAYER = re.compile(rf"^{re.escape(MODEL)}layers\.(\d+)\.(.+)$")


def block_dims(config: Config) -> K3Dims:
    """The sizes of an MTP layer's decoder block: vLLM builds it without attention
    residuals (`block_config.attn_res_block_size = None`)."""
    return dataclasses.replace(K3Dims.of(config), attn_res=False)


class KimiK3MtpDraft(DraftFamily):
    name = "kimi_k3_mtp"
    standalone = False  # it comes inside its target, never with --draft
    quant_refusals: ClassVar[Mapping[str, str]] = {
        "*": "Kimi-K3's MTP layers are laid out for bfloat16 checkpoints only (quantized "
        "ones are not proven against vLLM); convert the target alone with --no-mtp"
    }

    def read_config(self, config: Config) -> dict[str, Any]:
        return text_config(config) if "text_config" in config else dict(config)

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        d = K3Dims.counted(config)
        return d.counts(mtp_layers(config))

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._sources(config, ctx).items()}

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """Tensors whose checkpoint dtype is not the model's: the routing bias."""
        return {name: dtype for name, (_, dtype) in self._sources(config).items() if dtype}

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """The routed experts of the MTP layers that hold experts (`eh_proj` never)."""
        d = block_dims(config)
        return quantized_weights(filter(d.is_moe, mtp_layers(config)), d.experts, MODEL)

    def _sources(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
        d = block_dims(config)
        names = ctx.draft_names
        found: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for layer in mtp_layers(config):
            prefix = f"{MODEL}layers.{layer}."
            require_mtp_layer(names, prefix, layer, config)
            for t in d.layer_tensors(layer):
                dtype = F32 if t.hf.endswith("e_score_correction_bias") else None
                found[prefix + t.hf] = (t.shape, dtype)
            if d.is_moe(layer):
                experts = d.expert_shapes(prefix + "block_sparse_moe.experts.")
                found |= {name: (shape, None) for name, shape in experts.items()}
            found |= {prefix + name: ((d.hidden,), None) for name in NORMS}
            found[prefix + EH_PROJ] = ((d.hidden, 2 * d.hidden), None)
            found[prefix + LAYER_HEAD] = ((d.vocab, d.hidden), None)
            found[prefix + LAYER_EMBED] = ((d.vocab, d.hidden), None)
        return found

    def shared_copies(self, config: Config) -> dict[str, str]:
        """Each MTP layer's vocab head copies lm_head; the first one's embedding copies
        the target's."""
        layers = mtp_layers(config)
        copies = {f"{MODEL}layers.{layer}.{LAYER_HEAD}": HEAD for layer in layers}
        return copies | {f"{MODEL}layers.{layers.start}.{LAYER_EMBED}": EMBED}

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        """The MTP layers have the target's sizes: the target's checks cover them."""
        return []

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d = block_dims(config)
        last, layers = topology.last_stage, mtp_layers(config)
        distinct = ctx.distinct_copies
        params: list[Param] = []
        skipped: dict[str, str] = {}
        shared: set[str] = set()
        for layer in layers:
            source, vllm = f"{MODEL}layers.{layer}.", f"model.layers.{layer}."
            block = (
                (vllm + BLOCK + name.removeprefix(source), piece, dtype)
                for name, piece, dtype in d.layer_params(layer)
            )
            params += fused_params(block, last)
            for name in (*NORMS, EH_PROJ):
                params.append(Param(vllm + name, (Piece(source + name, Cut.REPLICATE),), (last,)))
            if source + LAYER_HEAD in distinct:  # vLLM shares the target's only where equal
                head = Piece(source + LAYER_HEAD, Cut.VOCAB)
                params.append(Param(vllm + LAYER_HEAD, (head,), (last,)))
            else:
                shared.add(vllm + LAYER_HEAD)
                skipped[source + LAYER_HEAD] = (
                    f"equal to {HEAD}, byte for byte: vLLM serves the MTP draft with the "
                    "target's lm_head"
                )
            if layer != layers.start:
                skipped[source + LAYER_EMBED] = "vLLM loads the first MTP layer's embedding only"
        first_copy = f"{MODEL}layers.{layers.start}.{LAYER_EMBED}"
        if topology.pp > 1 or first_copy in distinct:
            if first_copy not in shapes:
                raise ConfigError(
                    f"at pp > 1 vLLM's Kimi-K3 MTP draft keeps its own embedding and fills it "
                    f"from {first_copy} only, which the checkpoint lacks (vLLM would leave it "
                    "unset); convert with --pp 1, or with --no-mtp to leave the draft out"
                )
            params.append(Param(DRAFT_EMBED, (Piece(first_copy, Cut.VOCAB),), (last,)))
        else:
            shared.add(DRAFT_EMBED)
            skipped[first_copy] = (
                f"equal to {EMBED}, byte for byte: at pp=1 vLLM serves the MTP draft with the "
                "target's embedding"
            )
        used = {piece.source for param in params for piece in param.pieces}
        for name in shapes:
            if name in used or name in skipped:
                continue
            match = LAYER.match(name)
            if match is None or int(match[1]) not in layers:
                skipped[name] = "a tensor of the target"
            elif "_res_" in match[2]:
                skipped[name] = "vLLM builds the MTP block without attention residuals"
        skipped = {name: why for name, why in skipped.items() if name in shapes}
        return Layout(
            tuple(params),
            skipped,
            shared_with_target=frozenset(shared),
            optional_sources=frozenset(
                f"{MODEL}layers.{layer}.{name}"
                for layer in layers
                for name in (LAYER_HEAD, LAYER_EMBED)
            ),
            num_experts=d.experts,
        )

    def after_fill(self, model: Any, filled: set[str]) -> None:
        """The KDA layers' decode copies, as for the target (an MTP layer may be KDA)."""
        KimiK3Family().after_fill(model, filled)
