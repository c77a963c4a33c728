"""Qwen3-Next's MTP draft (`Qwen3NextMTP`): the `mtp.*` layers its checkpoint carries,
each a full-attention layer of the target's sizes, served on the last stage."""

from __future__ import annotations

from typing import ClassVar

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
from shardprep.plan.archs.qwen3_next.family import (
    EMBED,
    FULL,
    HEAD,
    MTP_OWN,
    NextDims,
    Qwen3NextFamily,
    quantized_weights,
)
from shardprep.plan.cuts import Cut, Piece
from shardprep.plan.topology import Topology


class Qwen3NextMtpDraft(DraftFamily):
    name = "qwen3_next_mtp"
    standalone = False  # it comes inside its target, never with --draft
    dims: ClassVar[type[NextDims]] = NextDims
    embed_source = EMBED  # the target's embedding, in the checkpoint
    quant_schemes = Qwen3NextFamily.quant_schemes
    quant_refusals = Qwen3NextFamily.quant_refusals

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """The target's counts, and each MTP layer's tensors (its experts' too, when each
        expert has its own)."""
        d = self.dims.counted(config)
        own = d.mtp + (3 * d.experts * d.moe_count(d.mtp) if not d.expert_count().stacks else 0)
        return [d.expert_count(), Count(d.mtp_key, d.mtp, own)]

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """The MTP layers' and `mtp.fc` (a column-parallel layer with the quantization)."""
        fc = {"mtp.fc.weight": "mtp.fc"} if "mtp.fc.weight" in shapes else {}
        return quantized_weights(shapes, "mtp.layers.") | fc

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        d, names = self.dims(config), ctx.draft_names
        if names is not None and not any(n.startswith("mtp.") for n in names):
            raise ConfigError(
                f"vLLM serves {d.label}'s MTP draft from the checkpoint's mtp.* tensors, and "
                "this checkpoint holds none; convert with --no-mtp to leave the draft out"
            )
        shapes: dict[str, tuple[int, ...]] = {"mtp.fc.weight": (d.hidden, 2 * d.hidden)}
        shapes |= {f"mtp.{name}": (d.hidden,) for name in MTP_OWN}
        for i in range(d.mtp):
            for suffix, shape in d.layer_shapes_of(i, FULL).items():
                shapes[f"mtp.layers.{i}.{suffix}"] = shape
        return shapes

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        """The MTP layers have the target's sizes: the target's checks cover them."""
        return []

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        d, last = self.dims(config), topology.last_stage
        params: list[Param] = []
        for i in range(d.mtp):
            params += d.layer_params_of(i, FULL, f"mtp.layers.{i}.", f"model.layers.{i}.", last)
        params.append(Param("model.fc.weight", (Piece("mtp.fc.weight", Cut.ROWS),), (last,)))
        for name in MTP_OWN:
            params.append(Param(f"model.{name}", (Piece(f"mtp.{name}", Cut.REPLICATE),), (last,)))
        shared = {HEAD}  # loaded from lm_head.weight, then the target's
        if topology.pp > 1:  # the draft, on the last stage, keeps its own embedding
            params.append(Param(EMBED, (Piece(self.embed_source, Cut.VOCAB),), (last,)))
        else:
            shared.add(EMBED)
        used = {piece.source for param in params for piece in param.pieces}
        skipped = {name: "a tensor of the target" for name in shapes if name not in used}
        return Layout(
            tuple(params), skipped, shared_with_target=frozenset(shared), num_experts=d.experts
        )
