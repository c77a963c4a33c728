"""Runs in a child process with vLLM: builds vLLM's model of one rank at a time on the
meta device, feeds its own `DefaultModelLoader.load_weights` placeholder tensors with the
checkpoint's names, shapes and dtypes, and records every operation that writes a
parameter. Nothing here reads a weight: the placeholders hold no bytes.

Input: requests, one JSON line each on stdin: the model folder (config.json only), tp,
pp, the serving dtype, the ranks to derive, the checkpoint's tensors and the environment.
Output: a JSON file per rank in the request's `out` folder, `{"rank": [p, t], "params":
{...}, "ops": [...]}`, then one line on stdout: `{"vllm": its version}`, or
`{"error": "..."}`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardprep.plan.derived import draft_probe
from shardprep.plan.derived.built import BuiltFills, left_by_load
from shardprep.plan.derived.constants import Constants, Mixed
from shardprep.plan.derived.dequantized import COMPUTED, DEQUANTIZED, dequantized_name
from shardprep.plan.derived.engine import (
    as_cpu_worker,
    engine_config,
    kept_on_meta,
    no_peers,
    on_meta,
    real_expert_maps,
    set_rank,
)
from shardprep.plan.derived.experts import expert_stacks

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip
NAMES = {v: k for k, v in DTYPES.items()}
# Ops that only read (or make a fresh tensor nobody writes into a parameter unrecorded).
WRITES = {"copy_", "fill_", "zero_"}
# Ops whose result holds its input's values (cast or not), so a copy of it is a copy.
COPIES = {"_to_copy", "clone", "contiguous"}
SHOWN = {"_to_copy": "cast"}  # how an op is named in a refusal


class Refused(Exception):
    """A write the plan records cannot express."""


@dataclass(frozen=True)
class Made:
    """A tensor load_weights computed: the ops that made it, from which checkpoint tensor,
    and, for a plain copy (a cast, a clone) of one region of it, that region."""

    ops: tuple[str, ...]
    origin: str
    copy_of: tuple[Any, ...] | None = None
    value: float | None = None  # the constant it holds, a copy of a constant region


class Recorder(TorchDispatchMode):
    """Each op on meta tensors: views need no record (storage, offset, sizes and strides
    say where they point); a write into a parameter is recorded as a region of the
    parameter and a region of a placeholder; a value made from a placeholder (a cast,
    a clone) is followed to its origin, and anything else written into a parameter is
    refused with the ops that made it. A placeholder region set to a constant in place
    (`zero_`) is kept (constants.py): a copy out of it is a fill of that constant."""

    def __init__(
        self, params: dict[int, str], sources: dict[int, str], tensors: dict[str, Any]
    ) -> None:
        super().__init__()
        self.params = params
        self.sources = sources
        self.tensors = tensors  # the placeholders by name
        self.dequantized: dict[str, list[str]] = {}  # {weight + DEQUANTIZED: [weight, scale]}
        self.made: dict[int, Made] = {}
        self.ops: list[list[Any]] = []
        self.constants = Constants()  # placeholder regions set to a constant in place

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in ("detach", "alias"):
            return out
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in WRITES:
            self._write(name, args)
        elif name.endswith("_") and first is not None and self._key(first) in self.params:
            raise Refused(
                f"{self.params[self._key(first)]}: vLLM's load_weights applies {name} to it, "
                "value arithmetic a plan of copies cannot express"
            )
        elif isinstance(out, torch.Tensor) and out.is_meta:
            self._follow(name, args, out)
        return out

    def _region(self, t: torch.Tensor) -> list[Any]:
        return [t.storage_offset(), list(t.shape), list(t.stride())]

    def _key(self, t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _write(self, name: str, args: Any) -> None:
        dst = args[0]
        key = self._key(dst)
        param = self.params.get(key)
        value = 0 if name == "zero_" else None if name == "copy_" else float(args[1])
        if param is None:
            known = key in self.sources or key in self.made
            if known and value is not None:  # a fill: what it holds is known
                self.constants.set(key, self._region(dst), value)
            elif key in self.sources:
                raise Refused(
                    f"vLLM's load_weights writes into checkpoint tensor {self.sources[key]}"
                )
            elif key in self.made:  # a copy of something else into a value it made
                del self.made[key]
            return
        if value is None:
            value = self._constant(args[1], param)
        if value is None:
            self.ops.append(["copy", param, self._region(dst), *self._origin(args[1], param)])
        else:
            self.ops.append(["fill", param, self._region(dst), value])

    def _constant(self, src: torch.Tensor, param: str) -> float | None:
        """The constant a copy from `src` writes: a region of a placeholder set to it in
        place, or a whole copy of one; None for anything else."""
        key = self._key(src)
        made = self.made.get(key)
        try:
            value = self.constants.value(key, self._region(src))
        except Mixed:
            origin = self.sources[key] if made is None else made.origin
            raise Refused(
                f"{param}: vLLM's load_weights copies into it a region of {origin} "
                "that it set to a constant in part only"
            ) from None
        if value is None and made is not None and made.copy_of is not None:
            whole = src.storage_offset() == 0 and src.is_contiguous()
            return made.value if whole and src.numel() == made.copy_of[3] else None
        return value

    def _origin(self, src: torch.Tensor, param: str) -> list[Any]:
        key = self._key(src)
        if key in self.sources:
            return [self.sources[key], self._region(src), NAMES.get(src.dtype, str(src.dtype))]
        made = self.made.get(key)
        if made is None:
            raise Refused(f"{param}: vLLM's load_weights fills it with a value of its own")
        whole = src.storage_offset() == 0 and src.is_contiguous()
        if made.copy_of is not None and whole and src.numel() == made.copy_of[3]:
            if made.copy_of[0].endswith(DEQUANTIZED) and NAMES.get(src.dtype) != COMPUTED:
                raise Refused(
                    f"{param}: vLLM's load_weights dequantizes {made.origin} to {src.dtype}, "
                    "where convert computes bfloat16"
                )
            return list(made.copy_of[:3])
        raise Refused(
            f"{param}: vLLM's load_weights computes it from {made.origin} "
            f"({', '.join(made.ops)}), value arithmetic a plan of copies cannot express"
        )

    def _follow(self, name: str, args: Any, out: torch.Tensor) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        known = [a for a in tensors if self._key(a) in self.sources]
        if name in COPIES and len(known) == 1 and known[0] is args[0]:
            src = known[0]
            dtype = NAMES.get(src.dtype, str(src.dtype))
            region = (self.sources[self._key(src)], self._region(src), dtype, src.numel())
            try:
                value = self.constants.value(self._key(src), region[1])
            except Mixed:  # part constant: no copy of one region of either
                self.made[self._key(out)] = Made((name, "set in part to a constant"), region[0])
                return
            self.made[self._key(out)] = Made((SHOWN.get(name, name),), region[0], region, value)
            return
        before = [self.made[self._key(a)] for a in tensors if self._key(a) in self.made]
        made = self._dequantized(name, before, out)
        if made is not None:
            self.made[self._key(out)] = made
            return
        origins = [self.sources[self._key(a)] for a in known] + [m.origin for m in before]
        if origins:
            ops = (*(op for m in before[:1] for op in m.ops), SHOWN.get(name, name))
            self.made[self._key(out)] = Made(ops, origins[0])

    def _dequantized(self, name: str, before: list[Made], out: torch.Tensor) -> Made | None:
        """A weight times its block scales (dequantized.py), or a cast of one: a copy of
        the weight's dequantized values, which convert computes; None for anything else."""
        if name in COPIES and len(before) == 1:
            copy = before[0].copy_of
            if copy is None or not copy[0].endswith(DEQUANTIZED) or out.numel() != copy[3]:
                return None
            return Made((*before[0].ops, SHOWN.get(name, name)), before[0].origin, copy)
        if name != "mul" or len(before) != 2:
            return None
        for weight, scale in (before, before[::-1]):
            if weight.copy_of is None or scale.origin not in self.tensors:
                continue
            found = dequantized_name(
                (weight.origin, self.tensors[weight.origin], weight.copy_of[3]),
                (scale.origin, scale.ops, self.tensors[scale.origin]),
                out,
            )
            if found is not None:
                self.dequantized[found] = [weight.origin, scale.origin]
                region = [0, list(out.shape), list(out.stride())]
                return Made(("dequantize",), weight.origin, (found, region, COMPUTED, out.numel()))
        return None


def check_registered(architecture: str, version: str) -> None:
    from vllm.model_executor.models import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        raise Refused(
            f"architecture {architecture} is not registered in vLLM {version} either, so "
            "there is no model definition to derive its layout from; use a vLLM that "
            "serves it"
        )


def derive_rank(config: Any, request: dict[str, Any], p: int, t: int) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models import utils
    from vllm.utils.torch_utils import set_default_torch_dtype

    config.compilation_config.static_forward_context.clear()
    # vLLM keys each model's missing pipeline layers by id(model), which a model of an
    # earlier rank, freed, may have had: one model a process, as in a worker.
    utils._model_to_pp_missing_layer_names.clear()
    with set_current_vllm_config(config), no_peers():
        set_rank(config, request["tp"], request["pp"], p, t)
        model_config = draft_probe.model_config(config, request)
        dtype = set_default_torch_dtype(config.model_config.dtype)
        built = BuiltFills()  # as vLLM's loaders build a model, what it fills as it does
        with dtype, torch.device("meta"), kept_on_meta(), real_expert_maps(), built:
            model = initialize_model(vllm_config=config, model_config=model_config)
        fills = built.of_params(dict(model.named_parameters()))
        params = on_meta(model)
        placeholders = {
            name: torch.empty(shape, dtype=DTYPES[dtype], device="meta")
            for name, (dtype, shape) in request["tensors"].items()
        }
        recorder = Recorder(
            {v.untyped_storage()._cdata: k for k, v in params.items()},
            {v.untyped_storage()._cdata: k for k, v in placeholders.items()},
            placeholders,
        )

        class Placeholders(DefaultModelLoader):
            def get_all_weights(self, model_config: Any, model: Any) -> Any:
                yield from placeholders.items()

        loader = Placeholders(config.load_config)
        loader.counter_before_loading_weights = 0.0
        with set_default_torch_dtype(config.model_config.dtype), recorder:
            loader.load_weights(model, model_config)
        shared, may_share = draft_probe.shared(model, config) if request.get("draft") else ([], [])
    ops = recorder.ops  # every write, in order: a later one wins (overwrites.py)
    ops = ops + left_by_load(fills, ops)
    return {
        "rank": [p, t],
        "model_dtype": NAMES[config.model_config.dtype],
        "params": {k: [NAMES.get(v.dtype, str(v.dtype)), list(v.shape)] for k, v in params.items()},
        "ops": ops,
        "shared": shared,
        "may_share": may_share,
        "expert_stacks": expert_stacks(model),
        "dequantized": recorder.dequantized,
    }


def main() -> int:
    """Answer each request (one JSON line on stdin) with one line on stdout, until stdin
    closes: vLLM is imported once for every derivation of the parent process. After a
    failed one the child stops, so that no half-built state meets the next."""
    import vllm

    from shardprep.plan.derived import choices

    as_cpu_worker()
    choices.install()
    for line in sys.stdin:
        answer = serve(json.loads(line), vllm.__version__)
        print(json.dumps(answer), flush=True)
        if "error" in answer:
            return 1
    return 0


def serve(request: dict[str, Any], version: str) -> dict[str, str]:
    """Derive the request's ranks, a file each in its `out` folder, under its environment."""
    from shardprep.progress import Progress, Silent

    os.environ.clear()
    os.environ.update(request["env"])  # the parent's now, vLLM's partition among them
    out = Path(request["out"])
    bar = Progress if request.get("progress") else Silent
    try:
        check_registered(request["architecture"], version)
        config = engine_config(request)
        for p, t in bar(request["ranks"], desc="derive layout from vLLM", unit="rank"):
            record = derive_rank(config, request, p, t)
            (out / f"rank-{p}-{t}.json").write_text(json.dumps(record))
    except Refused as exc:
        return {"error": str(exc)}
    except Exception as exc:  # one line for the parent, whatever vLLM raised
        return {"error": f"vLLM raised {type(exc).__name__}: {exc}"}
    return {"vllm": version}


if __name__ == "__main__":
    sys.exit(main())
