"""DeepSeek-V3 multi-token prediction (MTP) drafts (vLLM's `deepseek_mtp.py`).

The draft lives inside the target checkpoint: layers L .. L+n-1 (L = num_hidden_layers,
n = num_nextn_predict_layers), each a full decoder layer plus `enorm`, `hnorm`,
`eh_proj` (a plain linear layer, never quantized), a `shared_head` (norm and vocab head)
and a copy of the embedding. `DeepSeekMTP.load_weights` names the decoder layer
`model.layers.{L+i}.mtp_block.*`, keeps the other names, and loads the embedding as
`model.embed_tokens` from the first MTP layer's copy when the checkpoint has one (it
comes after the top-level one and overwrites it), else from the top-level one.

After loading, vLLM's proposer replaces every `shared_head.head` with the target's
lm_head at any pp, and at pp = 1 the embedding with the target's (`_maybe_share_lm_head`,
`_maybe_share_embeddings`): those are not written. At pp > 1 the draft, on the last
stage, keeps its own embedding.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

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
from shardprep.plan.archs.deepseek.v3 import DeepseekFamily
from shardprep.plan.archs.parts.mla import fused_params
from shardprep.plan.archs.parts.mtp import BLOCK, HEAD, OWN, mtp_layers, require_mtp_layer
from shardprep.plan.archs.parts.names import LAYER
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology

EMBED = "model.embed_tokens.weight"
LAYER_EMBED = "embed_tokens.weight"


class DeepseekMtpDraft(DraftFamily):
    name = "deepseek_mtp"
    quant_schemes = frozenset({"fp8_block", "fp8_ct", "int4_pack", "mxfp4_pack", "nvfp4_pack"})
    experts_only_schemes = frozenset({"nvfp4_pack"})  # NVFP4 MLA layers: not proven yet
    standalone = False  # it comes inside its target, never with --draft
    # The target family whose decoder layers the MTP layers are.
    target: ClassVar[type[DeepseekFamily]] = DeepseekFamily

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The target's counts, and each MTP layer's own tensors and experts."""
        target = self.target()
        counted = target.counts(config)
        d, layers = target.dims(config), mtp_layers(config)
        tensors = len(layers) * len(OWN) + 3 * d.experts * d.moe_layers(layers)
        return [*counted, Count("num_nextn_predict_layers", len(layers), tensors)]

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self._sources(config, ctx).items()}

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """Tensors whose checkpoint dtype is not the model's: the routing bias."""
        return {name: dtype for name, (_, dtype) in self._sources(config).items() if dtype}

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """The decoder layer of each MTP layer (`eh_proj` is never quantized)."""
        target = self.target()
        d = target.dims(config)
        found: dict[str, str] = {}
        for layer in mtp_layers(config):
            found |= target.layer_quantized(d, layer)
        return found

    def _sources(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
        target = self.target()
        d = target.dims(config)
        names = ctx.draft_names
        found: dict[str, tuple[tuple[int, ...], str | None]] = {}
        for layer in mtp_layers(config):
            prefix = f"model.layers.{layer}."
            require_mtp_layer(names, prefix, layer, config)
            found |= target.layer_sources(d, layer)
            found |= {prefix + name: ((d.hidden,), None) for name in OWN}
            found[prefix + "eh_proj.weight"] = ((d.hidden, 2 * d.hidden), None)
            found[prefix + HEAD] = ((d.vocab, d.hidden), None)
            found[prefix + LAYER_EMBED] = ((d.vocab, d.hidden), None)
        return found

    def shared_copies(self, config: Config) -> dict[str, str]:
        """Each MTP layer's vocab head copies lm_head; the first one's embedding copies
        the target's."""
        layers = mtp_layers(config)
        copies = {f"model.layers.{layer}.{HEAD}": "lm_head.weight" for layer in layers}
        return copies | {f"model.layers.{layers.start}.{LAYER_EMBED}": EMBED}

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        """The MTP layers have the target's sizes: the target's checks cover them."""
        return []

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        target = self.target()
        d = target.dims(config)
        last, layers = topology.last_stage, mtp_layers(config)
        params: list[Param] = []
        skipped: dict[str, str] = {}
        shared: set[str] = set()
        optional: set[str] = set()
        distinct = ctx.distinct_copies
        for layer in layers:
            prefix = f"model.layers.{layer}."
            block = target.layer_params(d, layer, prefix)
            params += fused_params(_in_block(block, prefix), last)
            for name in OWN:
                params.append(Param(prefix + name, (Piece(prefix + name, Cut.REPLICATE),), (last,)))
            optional |= {prefix + HEAD, prefix + LAYER_EMBED}
            if prefix + HEAD in distinct:  # vLLM shares the target's only where they are equal
                params.append(Param(prefix + HEAD, (Piece(prefix + HEAD, Cut.VOCAB),), (last,)))
            else:
                shared.add(prefix + HEAD)
                skipped[prefix + HEAD] = (
                    "equal to lm_head.weight, byte for byte: vLLM serves the MTP draft with the "
                    "target's lm_head"
                )
            if layer != layers.start:
                skipped[prefix + LAYER_EMBED] = "vLLM loads the first MTP layer's embedding only"
        first_copy = f"model.layers.{layers.start}.{LAYER_EMBED}"
        embed = first_copy if first_copy in shapes else EMBED
        if topology.pp > 1 or first_copy in distinct:
            params.append(Param(EMBED, (Piece(embed, Cut.VOCAB),), (last,)))
        else:
            shared.add(EMBED)
            skipped[first_copy] = (
                f"equal to {EMBED}, byte for byte: at pp=1 vLLM serves the MTP draft with the "
                "target's embedding"
            )
        used = {piece.source for param in params for piece in param.pieces}
        for name in shapes:
            match = LAYER.match(name)
            if name in used or name in skipped:
                continue
            beyond = match is not None and int(match[1]) >= layers.stop
            skipped[name] = "not a layer vLLM builds" if beyond else "a tensor of the target"
        skipped = {name: why for name, why in skipped.items() if name in shapes}
        return Layout(
            tuple(params),
            skipped,
            shared_with_target=frozenset(shared),
            optional_sources=frozenset(optional),
            num_experts=d.experts,
            num_expert_group=d.groups,
        )


def _in_block(
    entries: Iterator[tuple[str, Piece, str | None]], prefix: str
) -> Iterator[tuple[str, Piece, str | None]]:
    """vLLM's `_rewrite_spec_layer_name`: the decoder layer's parameters under `mtp_block.`."""
    for name, piece, dtype in entries:
        yield prefix + BLOCK + name.removeprefix(prefix), piece, dtype
