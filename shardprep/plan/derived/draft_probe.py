"""Runs in the deriving child, beside probe.py: the draft vLLM builds for a speculative
`method` (the MTP layers a target checkpoint carries, `--speculative-config
'{"method": "mtp", ...}'`), on the last stage, and the parameters vLLM's proposer then
replaces with the target's (its `_maybe_share_embeddings` and `_maybe_share_lm_head`,
run on the meta model beside a stand-in target).

A record of a draft rank differs from a target's in one way: `shared` lists the
parameters the proposer replaces, which hold nothing of their own after loading."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


def speculative(request: dict[str, Any]) -> dict[str, Any] | None:
    """The `--speculative-config` a draft request stands for; None for a target."""
    method = request.get("draft")
    return None if method is None else {"method": method, "num_speculative_tokens": 1}


def model_config(config: Any, request: dict[str, Any]) -> Any:
    """The model config of what the request derives: the draft's, or the target's."""
    if request.get("draft") is None:
        return config.model_config
    return config.speculative_config.draft_model_config


class _Target(nn.Module):
    """What the proposer takes from the target: its lm_head and its embedding."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(embed, requires_grad=False)


def shared(model: nn.Module, config: Any) -> list[str]:
    """The draft parameters vLLM's proposer replaces with the target's after loading,
    found by running its own sharing code on the meta model (which it changes)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    before = dict(model.named_parameters(remove_duplicate=False))
    target = _Target(torch.empty(0, device="meta"), torch.empty(0, device="meta"))
    proposer = SimpleNamespace(model=model, vllm_config=config, use_local_argmax_reduction=False)
    SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)  # type: ignore[arg-type]
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)  # type: ignore[arg-type]
    theirs = {id(p) for p in target.parameters()}
    after = dict(model.named_parameters(remove_duplicate=False))
    return sorted(name for name in before if id(after.get(name)) in theirs)
