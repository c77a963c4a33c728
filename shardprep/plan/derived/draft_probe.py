"""Runs in the deriving child, beside probe.py: the draft vLLM builds for a speculative
`method`, on the last stage: the MTP layers a target checkpoint carries (`--speculative-
config '{"method": "mtp", ...}'`), or a draft checkpoint of its own (`"method": "eagle3",
"model": DRAFT`, the request's `draft_folder` holding the draft's config.json); and the
parameters vLLM's proposers then replace with the target's.

A record of a draft rank differs from a target's in two ways: `shared` lists the
parameters the proposers replace whatever the draft holds (they hold nothing of their
own after loading), `may_share` those they replace only where the draft's bytes equal
the target's (an EAGLE-style draft's own embedding or lm_head): written, and allowed to
be the target's at load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch import nn


def speculative(request: dict[str, Any]) -> dict[str, Any] | None:
    """The `--speculative-config` a request stands for: the draft's it derives, or that
    of the draft a target is derived beside (`beside`); None for a target alone."""
    method = request.get("draft") or request.get("beside")
    if method is None:
        return None
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 1}
    if request.get("draft_folder"):
        spec["model"] = request["draft_folder"]
    return spec


@contextmanager
def building(request: dict[str, Any]) -> Iterator[None]:
    """While vLLM makes the engine config of a request with a draft: without the CPU model
    runner's list of speculative methods it does not run (DSpark), a check of the runner
    (GPUs run such a draft with the V2 runner), not of the model built."""
    if speculative(request) is None:
        yield
        return
    with _runner_unchecked():
        yield


@contextmanager
def _runner_unchecked() -> Iterator[None]:
    from vllm.config.vllm import VllmConfig

    with mock.patch.object(VllmConfig, "_validate_v1_model_runner", lambda self: None):
        yield


def model_config(config: Any, request: dict[str, Any]) -> Any:
    """The model config of what the request derives: the draft's, or the target's."""
    if request.get("draft") is None:
        return config.model_config
    return config.speculative_config.draft_model_config


class _Target(nn.Module):
    """What a proposer takes from the target: its lm_head and its embedding."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lm_head = nn.Module()
        self.lm_head.weight = nn.Parameter(torch.empty(1, hidden, device="meta"), False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = nn.Parameter(torch.empty(1, hidden, device="meta"), False)


def shared(model: nn.Module, config: Any) -> tuple[list[str], list[str]]:
    """The draft parameters vLLM's proposers replace with the target's after loading:
    those replaced whatever the bytes, and those replaced only where the draft's own
    bytes equal the target's. Found by running vLLM's own sharing code on the meta model
    beside a stand-in target, once told every compared pair differs and once that it is
    equal, with each of its model runners that runs the method (V1's proposer, and the
    V2 runner's loader of the method, which also shares an EAGLE-style draft's embedding
    at pp > 1). What they attach where the draft built nothing counts for an EAGLE-style
    draft only (`_eagle_style`)."""
    target = _Target(config.model_config.get_hidden_size())
    theirs = {id(p) for p in target.parameters()}
    built = set(dict(model.named_parameters(remove_duplicate=False)))
    eagle = _eagle_style(model)
    found = []
    runners = [_share_v2]
    if not config._get_v1_model_runner_unsupported_features():  # V1 runs the method
        runners.append(_share_v1)
    for share in runners:
        for equal in (False, True):
            with _restored(model), _compared(equal), _runner_unchecked():
                share(model, target, config)
                after = dict(model.named_parameters(remove_duplicate=False))
                found.append(
                    {n for n, p in after.items() if id(p) in theirs and (eagle or n in built)}
                )
    always = set.intersection(*found)
    return sorted(always), sorted(set.union(*found) - always)


def _eagle_style(model: nn.Module) -> bool:
    """Whether vLLM treats the draft as EAGLE-style, one that uses the target's embedding
    and lm_head unless it holds its own (`supports_any_eagle`, or its `has_own_*` flags):
    then what the proposers attach of the target's counts as shared even where the draft
    builds none. Otherwise (MTP) only the parameters it built and they replace do."""
    from vllm.model_executor.models.interfaces import supports_any_eagle

    flags = ("has_own_embed_tokens", "has_own_lm_head")
    return supports_any_eagle(model) or any(hasattr(model, flag) for flag in flags)


def _share_v1(model: nn.Module, target: nn.Module, config: Any) -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(model=model, vllm_config=config, use_local_argmax_reduction=False)
    SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)  # type: ignore[arg-type]
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)  # type: ignore[arg-type]


# The V2 runner's draft loader of a speculative method, where not the EAGLE one
# (vllm/v1/worker/gpu/spec_decode/__init__.py's `init_speculator`): {method: (module under
# vllm.v1.worker.gpu.spec_decode, function)}.
V2_LOADERS = {
    "dflash": ("dflash.utils", "load_dflash_model"),
    "dspark": ("dspark.utils", "load_dspark_model"),
}
V2_EAGLE = ("eagle.utils", "load_eagle_model")


def _share_v2(model: nn.Module, target: nn.Module, config: Any) -> None:
    """vLLM's V2 draft loader of the method, its `get_model` handing it the built model."""
    import importlib

    import vllm.model_executor.model_loader as loaders

    where, function = V2_LOADERS.get(config.speculative_config.method, V2_EAGLE)
    module = importlib.import_module(f"vllm.v1.worker.gpu.spec_decode.{where}")
    with ExitStack() as stack:
        for owner in (module, loaders):
            if hasattr(owner, "get_model"):
                stack.enter_context(mock.patch.object(owner, "get_model", lambda **kw: model))
        getattr(module, function)(target, config)


@contextmanager
def _compared(equal: bool) -> Iterator[None]:
    """vLLM's byte comparisons of a draft's tensor with the target's answered `equal`
    (the meta tensors hold no bytes), their copies to the CPU left on meta."""
    real_cpu: Callable[..., torch.Tensor] = torch.Tensor.cpu

    def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if tensor.is_meta else real_cpu(tensor, *args, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch, "equal", lambda a, b: equal))
        stack.enter_context(mock.patch.object(torch.Tensor, "cpu", cpu))
        yield


@contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """The model's modules put back as they were after the sharing code replaced or added
    some."""
    before = dict(model.named_modules(remove_duplicate=False))
    try:
        yield
    finally:
        for name, module in before.items():  # parents before their children
            if not name:
                continue
            owner, _, attr = name.rpartition(".")
            parent = model.get_submodule(owner)
            if getattr(parent, attr, None) is not module:
                setattr(parent, attr, module)
        added = set(dict(model.named_modules(remove_duplicate=False))) - set(before)
        for name in sorted(added, key=len, reverse=True):  # children before their parents
            owner, _, attr = name.rpartition(".")
            delattr(model.get_submodule(owner), attr)
