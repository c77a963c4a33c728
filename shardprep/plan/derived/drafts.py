"""The MTP draft of a derived target (`DerivedMtpDraft`), derived the same way: vLLM
builds the draft of `--speculative-config '{"method": "mtp", ...}'` for each rank of the
last stage (the only stage that holds a draft) and runs its own `load_weights` on the
target checkpoint's placeholders (probe.py, draft_probe.py). What its proposer then
replaces with the target's (the lm_head copies, and at pp = 1 the embedding) is the
draft's `shared_with_target`: not written, as the hand-written MTP families do. Here:
what turns those records into a draft's layout, and the target's side of it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from shardprep.plan.archs.base import Config, Layout

MTP = "mtp"
# The methods of drafts given with `--draft` whose layout is derived (standalone.py).
STANDALONE = frozenset({"eagle", "eagle3", "dflash", "dspark"})
DERIVED_METHODS = STANDALONE | {MTP}
# config.json's count of MTP layers, under the names vLLM reads it by (DeepSeek-style
# and Qwen3.5-style checkpoints), at the top or in a text model's config.
MTP_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
MTP_HELD = "vLLM's MTP draft reads it, and the draft holds it"


@dataclass(frozen=True)
class Speculative:
    """A draft checkpoint of its own (`--draft`): vLLM's speculative method for it and its
    config.json (as sorted JSON text, so that a derivation can be cached by it)."""

    method: str
    text: str

    @classmethod
    def of(cls, method: str, config: Config) -> Speculative:
        return cls(method, json.dumps(dict(config), sort_keys=True, default=repr))

    @property
    def config(self) -> dict[str, Any]:
        return dict(json.loads(self.text))


def mtp_layers(config: Config) -> int:
    """How many MTP layers config.json promises (0: none)."""
    for where in (config, config.get("text_config")):
        if not isinstance(where, Mapping):
            continue
        for key in MTP_COUNTS:
            value = where.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def split_shared(record: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A draft rank's record without the parameters vLLM shares with the target, and the
    checkpoint tensors only those were loaded from ({source: parameter})."""
    shared = set(record.get("shared", ()))
    ops = [op for op in record["ops"] if op[1] not in shared]
    read = {op[3] for op in ops if op[0] == "copy"}
    left = {op[3]: op[1] for op in record["ops"] if op[1] in shared and op[0] == "copy"}
    params = {k: v for k, v in record["params"].items() if k not in shared}
    found = {**record, "ops": ops, "params": params}
    return found, {source: param for source, param in left.items() if source not in read}


def with_shared(layout: Layout, shared: Collection[str], sources: Mapping[str, str]) -> Layout:
    """The layout of a draft whose parameters `shared` vLLM replaces with the target's,
    each source only they were loaded from skipped saying so."""
    skipped = dict(layout.skipped)
    for source, param in sources.items():
        skipped[source] = (
            f"loaded into {param}, which vLLM replaces with the target's after loading"
        )
    return dataclasses.replace(layout, skipped=skipped, shared_with_target=frozenset(shared))


def held_by_draft(target: Layout, draft: Layout) -> Layout:
    """The target's layout with the tensors it leaves to its MTP draft saying so."""
    held = {piece.source for param in draft.params for piece in param.pieces}
    skipped = {name: MTP_HELD if name in held else why for name, why in target.skipped.items()}
    return dataclasses.replace(target, skipped=skipped)


def built_beside(alone: Layout, beside: Layout) -> Layout:
    """The target's layout as vLLM builds it beside a draft (`beside`), each stage it adds
    to a parameter only then (`alone` lacks it) marked spec-decode only."""
    stages = {param.name: set(param.stages) for param in alone.params}
    added = {
        (param.name, stage)
        for param in beside.params
        for stage in param.stages
        if stage not in stages.get(param.name, set())
    }
    return dataclasses.replace(beside, spec_decode_only=beside.spec_decode_only | added)
