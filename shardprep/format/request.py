"""The conversion request: every option that shaped a plan, recorded in the manifest so
that `verify --full` and a rerun replay exactly what was asked, never a guess."""

from __future__ import annotations

from dataclasses import dataclass

from shardprep.constants import DEFAULT_MAX_PART_BYTES


@dataclass(frozen=True)
class ConversionRequest:
    tp: int
    pp: int
    draft: str | None = None  # a draft folder (absolute) or repo id given with --draft
    draft_method: str | None = None
    partition: str | None = None  # layers per stage, "31,30"; None: vLLM's default
    stage: int | None = None  # --stage: one stage only
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES
    dtype: str = "auto"
    revision: str | None = None
    expert_parallel: bool = False
    expert_placement: str = "linear"
    dp: int = 1  # vLLM's --data-parallel-size: with expert parallelism, EP size = tp x dp
    mtp_draft: bool = True  # the MTP layers a target carries become its draft (--no-mtp: no)
    # --mxfp4-pad: the MXFP4 MoE backend's padding ("64", "128,256"); None: the default
    mxfp4_pad: str | None = None
