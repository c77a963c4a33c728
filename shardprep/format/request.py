"""The conversion request: every option that shaped a plan, recorded in the manifest so
that `verify --full` and a rerun replay exactly what was asked, never a guess."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardprep.constants import DEFAULT_MAX_PART_BYTES
from shardprep.errors import ConfigError, printable

# A revision as the Hub accepts one: a branch, tag or commit name (git's rules for a ref
# name, in ASCII): names of letters, digits and `._+-` joined by `/`, none starting with
# `.` or ending with `.` or `.lock`, no `..`. huggingface_hub writes it as a path under
# the cache's refs/ folder: anything else could name a file outside it. The same pattern
# is in docs/manifest.schema.json.
REVISION = re.compile(
    r"(?=.{1,256}$)(?!.*\.\.)(?!.*\.(lock)?(/|$))"
    r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*(/[A-Za-z0-9_+-][A-Za-z0-9._+-]*)*"
)


def check_revision(revision: str, what: str = "--revision") -> None:
    if not REVISION.fullmatch(revision):
        raise ConfigError(
            f"{what} {printable(repr(revision), 80)} is not a branch, tag or commit name the "
            "Hub accepts (letters, digits and ._+- in names joined by /, no '..'); "
            "give one such as main, v1.0 or a 40-hex commit id"
        )


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
