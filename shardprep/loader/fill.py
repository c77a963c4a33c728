"""Copying the tensors read into the model vLLM built: every parameter exactly once, with
its exact shape and dtype, or one error that lists every problem.

One exception, which the family names (`Family.padded_at_load`): a parameter that vLLM
builds longer along dim 0 on some devices than the rank's share (DeepSeek-V4's
`attn_sink`, padded to the head count of the GPU attention kernel) gets the rank file's
rows at its front and keeps the rest as vLLM initialized it, which is what vLLM's own
loader leaves (`param[:n].copy_(...)`).

Expert stacks whose size the MoE kernel backend chooses (MXFP4: `stack_pads`, from
plan/quant/backend_pad.py) are stored unpadded and copied into the parameter the backend
built as its weight loader would place them, the rest of the parameter zero.

Tensors of a part vLLM left unbuilt for this run (a vision tower whose modalities
`--limit-mm-per-prompt` sets to 0, or `--language-model-only`: a `StageMissingLayer`) are
skipped, as vLLM's own loader skips them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardprep.errors import WeightMismatchError, summarize
from shardprep.format.headers import TensorInfo
from shardprep.loader.cpu_read import torch_dtypes

if TYPE_CHECKING:
    from shardprep.plan.quant.backend_pad import Placement, StackPad

logger = logging.getLogger(__name__)
# Where a stored tensor goes in the parameter of that name, when the backend may have
# padded it: the copies (destination and source spans per dimension), None when it does
# not fit. A parameter it gives nothing for must have the stored shape.
StackPads = Callable[[str, tuple[int, ...], tuple[int, ...]], "tuple[Placement, ...] | None"]


def no_stack_pads(name: str, stored: tuple[int, ...], built: tuple[int, ...]) -> None:
    return None


def stack_pads(method: str | None) -> StackPads:
    """The backend padding of the expert stacks of a model vLLM quantizes with `method`
    (`shardprep.plan.quant.backend_pad`); none for a method without it."""
    if not method:  # unquantized: nothing to import
        return no_stack_pads
    from shardprep.plan.quant import backend_pad  # pure data, only where it pads

    if not backend_pad.pads_by_backend(method):
        return no_stack_pads

    def placed(
        name: str, stored: tuple[int, ...], built: tuple[int, ...]
    ) -> tuple[Placement, ...] | None:
        pad: StackPad | None = backend_pad.stack_pad(method, name)
        return None if pad is None else backend_pad.placements(stored, built, pad)

    return placed


class Destinations:
    """Where the reader may put a tensor directly: the parameter (or buffer) of that
    name, when it is contiguous, of the exact shape and dtype, and not handed out yet.
    Anything else gets None, and `fill_parameters` reports it. The model's parameters are
    listed once, here, for both (`fill_parameters(..., into=...)`)."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors, self.canonical, self.required = _parameters(model)
        self.dtypes = torch_dtypes(torch)
        self.claimed: set[str] = set()

    def __call__(self, name: str, info: TensorInfo) -> torch.Tensor | None:
        target = self.tensors.get(name)
        if target is None or self.canonical[name] in self.claimed:
            return None
        data = target.data
        if tuple(data.shape) != info.shape or data.dtype != self.dtypes.get(info.dtype):
            return None
        if not data.is_contiguous() or data.device.type != "cpu":
            return None
        self.claimed.add(self.canonical[name])
        return data


@dataclass
class Problems:
    """What did not fit, collected over the whole rank and raised once."""

    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)
    shape: list[str] = field(default_factory=list)
    dtype: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            (self.missing, "parameter(s) missing from the files"),
            (self.extra, "tensor(s) the model does not have"),
            (self.twice, "parameter(s) filled more than once"),
            (self.shape, "shape mismatch(es)"),
            (self.dtype, "dtype mismatch(es)"),
        ]
        found = [f"{len(items)} {what} ({summarize(items)})" for items, what in parts if items]
        return "; ".join(found)


def fill_parameters(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    ignorable: set[str],
    may_lack: set[str],
    where: str,
    layout: str = "",
    padded: Callable[[str], bool] = lambda name: False,
    stacks: StackPads = no_stack_pads,
    into: Destinations | None = None,
) -> list[str]:
    """Copy each tensor into the parameter of the same name (tied aliases count as the
    parameter they alias); every parameter must be filled exactly once with the exact
    shape and dtype, except those in `may_lack`. A tensor may also fill a buffer (e.g.
    attention scales), which is never required. Tensors in `ignorable` that the model
    lacks are skipped. A parameter for which `padded(name)` holds may be longer along dim
    0 than its tensor (`fits_padded`): the tensor fills its front. An expert stack the
    MoE backend padded (`stacks`) gets the tensor where the backend's weight loader puts
    it, zeros elsewhere. `into`, the `Destinations` the reader was given, saves listing the
    model's parameters again. Returns the names filled; raises one error listing every
    problem."""
    params, canonical, required = (
        (into.tensors, into.canonical, into.required) if into is not None else _parameters(model)
    )
    unbuilt = unbuilt_prefixes(model)
    problems, filled, seen, skipped = Problems(), {}, set(), 0
    for name, tensor in tensors:
        if name in params:
            seen_before = canonical[name] in seen
            target = params[name]
            spans = None
            if tuple(tensor.shape) != tuple(target.shape):
                spans = stacks(name, tuple(tensor.shape), tuple(target.shape))
            if _fill_one(name, tensor, target, seen_before, problems, padded(name), spans):
                filled[canonical[name]] = name
            seen.add(canonical[name])
        elif name.startswith(unbuilt):
            skipped += 1
        elif name not in ignorable:
            problems.extra.append(name)
        del tensor  # let the reader free a part before it stages the next one
    if skipped:
        logger.info(
            "skipped %d tensor(s) of %s that vLLM did not build for this run (%s)",
            skipped, where, ", ".join(p.rstrip(".") for p in unbuilt),
        )  # fmt: skip
    problems.missing = [
        key
        for key, names in _aliases(canonical).items()
        if key in required and key not in seen and not names & may_lack
    ]
    if any(vars(problems).values()):
        raise WeightMismatchError(
            f"the rank files of {where} do not fit the model vLLM built: {problems.summary()}. "
            f"They follow vLLM layout {layout or 'unknown'}; convert again with a shardprep "
            "that matches this vLLM, or load the original model with --load-format auto"
        )
    return list(filled.values())


def unbuilt_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes of the parts vLLM left out of this run (`StageMissingLayer`)."""
    try:
        from vllm.model_executor.models.utils import StageMissingLayer
    except ImportError:  # a vLLM without such parts
        return ()
    modules = model.named_modules()
    return tuple(f"{name}." for name, part in modules if isinstance(part, StageMissingLayer))


def fits_padded(stored: tuple[int, ...], built: tuple[int, ...]) -> bool:
    """A stored tensor that fills the front of a parameter padded along dim 0: the same
    other dims, at most as many rows."""
    return len(stored) == len(built) >= 1 and stored[1:] == built[1:] and stored[0] <= built[0]


def _fill_one(
    name: str,
    tensor: torch.Tensor,
    target: torch.Tensor,
    seen: bool,
    problems: Problems,
    padded: bool = False,
    spans: tuple[Placement, ...] | None = None,
) -> bool:
    """Copy one tensor if it fits; else record why not. A `padded` parameter longer along
    dim 0 gets the tensor at its front; its other rows keep vLLM's initial value. With
    `spans`, the tensor goes where they say and the rest of the parameter is zero."""
    shape, built = tuple(tensor.shape), tuple(target.shape)
    if seen:
        problems.twice.append(name)
    elif spans is not None and tensor.dtype == target.dtype:
        _fill_spans(target.data, tensor, spans)
        return True
    elif shape != built and not (padded and fits_padded(shape, built)) and spans is None:
        problems.shape.append(f"{name}: file {shape}, model {built}")
    elif tensor.dtype != target.dtype:
        problems.dtype.append(f"{name}: file {tensor.dtype}, model {target.dtype}")
    else:
        dest = target.data if shape == built else target.data[: shape[0]]
        if tensor.data_ptr() != dest.data_ptr():  # else it was read straight into it
            dest.copy_(tensor)
        return True
    return False


def _fill_spans(target: torch.Tensor, tensor: torch.Tensor, spans: tuple[Placement, ...]) -> None:
    """Zero the parameter, then copy each span of the tensor into its place."""
    target.zero_()
    for dest, source in spans:
        into = target[tuple(slice(*d) for d in dest)]
        into.copy_(tensor[tuple(slice(*s) for s in source)])


def _parameters(
    model: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, str], set[str]]:
    """Every parameter name (tied aliases included), and the first name of each; then the
    buffers, likewise (they may be filled, they are not required); and the parameters'
    first names (those `named_parameters()` gives), the ones that must be filled."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    canonical = {name: first.setdefault(id(p), name) for name, p in tensors.items()}
    required = set(first.values())
    for name, buffer in model.named_buffers(remove_duplicate=False):
        tensors[name] = buffer
        canonical[name] = first.setdefault(id(buffer), name)
    return tensors, canonical, required


def _aliases(canonical: dict[str, str]) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for name, key in canonical.items():
        names.setdefault(key, set()).add(name)
    return names
