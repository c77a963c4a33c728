"""The plan's records: what planning reads of a checkpoint (`SourceModel`) and what it
decides (`Plan`: every rank file, every tensor in it, the blocks it is made of). Pure data,
so a test feeds header dicts and a 1 TB model plans in milliseconds."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardprep.format.headers import TensorSpec
from shardprep.format.records import Topology
from shardprep.plan.cuts import Block, Piece
from shardprep.plan.experts import StackBlocks
from shardprep.plan.topology import ExpertSplit


@dataclass(frozen=True)
class SourceModel:
    """What planning needs of a checkpoint: its config and tensor headers."""

    config: Mapping[str, Any]
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)

    @functools.cached_property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """name -> shape, made once (every expert stack of every rank looks shapes up)."""
        return {name: shape for name, (_, shape) in self.tensors.items()}

    @functools.cached_property
    def dtypes(self) -> Mapping[str, str]:
        """name -> dtype (safetensors names), made once."""
        return {name: dtype for name, (dtype, _) in self.tensors.items()}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # Stacked along dim 0; zero blocks where source is None. An expert stack's are made
    # when asked (`blocks`), from its recipe.
    made_of: tuple[Block, ...] | StackBlocks
    experts: int = 0  # an expert stack [experts, rows per expert, ...] when > 0

    @property
    def blocks(self) -> tuple[Block, ...]:
        made_of = self.made_of
        return made_of if isinstance(made_of, tuple) else made_of.blocks()

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        """The shape as the dim-0 concatenation of the blocks (same bytes, row-major): an
        expert stack [experts, rows per expert, ...] is [experts x rows, ...] unless each
        block is one expert's row already (gpt-oss's vectors per expert, [experts, values])."""
        stacked = self.experts and len(self.shape) > 1
        if stacked and self._height() != self.shape[0]:
            return (self.shape[0] * self.shape[1], *self.shape[2:])
        return self.shape

    def _height(self) -> int:
        made_of = self.made_of
        if isinstance(made_of, tuple):
            return sum(block.height for block in made_of)
        return made_of.height


@dataclass(frozen=True)
class FilePlan:
    path: str
    role: str
    pp: int
    tp: int
    part: int
    tensors: tuple[TensorPlan, ...]
    # The dp rank whose experts this file holds; None: shared by every dp rank.
    dp: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.spec.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ExpertPlan:
    """How a mixture-of-experts model's routed experts are spread over the ranks."""

    split: ExpertSplit
    requested_placement: str  # --expert-placement-strategy; `split.placement` is vLLM's
    # The device-dependent layout the stacks follow, beyond the defaults (MXFP4 padding).
    assumptions: tuple[tuple[str, str], ...] = ()

    @property
    def rank_experts(self) -> tuple[tuple[int, ...], ...]:
        """The global experts each MoE rank holds, in local order."""
        return tuple(self.split.experts(rank) for rank in range(self.split.size))


@dataclass(frozen=True)
class ModelPlan:
    role: str
    architecture: str
    method: str | None
    dtype: str
    folder: str
    num_layers: int
    spec_decode_only: tuple[tuple[str, int], ...]
    shared_with_target: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    experts: ExpertPlan | None = None
    family: str = ""  # the family plug-in's name, which keys its layout revision
    quantization: str | None = None  # vLLM's quantization method of the stored weights
    scheme: str | None = None  # the quantization scheme's name, which keys its revision
    # Every parameter's pieces (on any stage) and the shapes of their sources: what a
    # loader needs to cut any rank of any coarser tp out of this plan's rank files.
    pieces: tuple[tuple[str, tuple[Piece, ...]], ...] = ()
    source_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class Plan:
    topology: Topology
    stages: tuple[int, ...]
    models: tuple[ModelPlan, ...]
    files: tuple[FilePlan, ...]
    notes: tuple[str, ...] = ()  # what a user should know of the plan, each a sentence
