"""ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`, as NVIDIA publishes its
`-FP4` and `-NVFP4` checkpoints), as vLLM's `ModelOptNvFp4Config` builds it before
`process_weights_after_loading`.

Each quantized weight `x.weight` [N, K] is stored under its own name as uint8 [N, K/2]
(two e2m1 values a byte), with `x.weight_scale` float8_e4m3fn [N, K/16] (one scale per
group of 16) and two float32 scalars, `x.weight_scale_2` (the weight's global scale) and
`x.input_scale` (the activations'). A linear layer (`ModelOptLinearMethod`) cuts the
weight and its group scales as the unquantized weight, in whole bytes and groups, and
holds one `weight_scale_2` and one `input_scale` per part of a fused layer
(`PerTensorScaleParameter`) on every rank. `ModelOptNvFp4FusedMoE` stacks the weights and
group scales as FusedMoE stacks any weight and the scalars per expert:
`w13_weight_scale_2`/`w13_input_scale` [E, 2] (gate, up), `w2_*` [E].

Layers vLLM leaves unquantized: config.json's `ignore` list, or `exclude_modules` of the
`quantization` section, matched as vLLM's `is_layer_excluded` matches them (exact names,
a fused layer through its parts, substrings, and fnmatch wildcards, a trailing `name*`
read as `name` and `name.*`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, ClassVar

from shardprep.plan.cuts import Cut, Piece, ScaleOf, matrix
from shardprep.plan.quant.base import NVFP4_MODELOPT, Example, Scheme
from shardprep.plan.quant.layer import Quantized, QuantParams

Config = Mapping[str, Any]
BYTE = "U8"
E4M3 = "F8_E4M3"
F32 = "F32"
GROUP = 16
PER_BYTE = 2
SCALARS = ("weight_scale_2", "input_scale")  # float32 scalars of each weight
SUPPORTED = (
    "shardprep supports ModelOpt NVFP4 (quant_algo NVFP4: 4-bit float weights and "
    "activations in groups of 16, no KV-cache quantization)"
)


@dataclass(frozen=True)
class ModeloptNvfp4(Scheme):
    name: ClassVar[str] = "modelopt_fp4"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "modelopt_fp4"  # vLLM's quantization method
    param_suffixes: ClassVar[tuple[str, ...]] = ("_scale", "_scale_2", "input_scale")
    kind: ClassVar[str] = "NVFP4"

    problem: str = ""  # why vLLM cannot load this quantization, if it cannot
    excluded: tuple[str, ...] = ()  # `ignore` / `exclude_modules`, as vLLM expands them
    group: int = GROUP

    @property
    def describe(self) -> str:
        return f"ModelOpt nvfp4 groups of {self.group}"

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """The checkpoint tensors of one quantized weight: {name: (shape, dtype)}."""
        rows, cols = shape
        stem = weight.removesuffix("weight")
        return {
            weight: ((rows, cols // PER_BYTE), BYTE),
            stem + "weight_scale": ((rows, cols // self.group), E4M3),
        } | {stem + scalar: ((), F32) for scalar in SCALARS}

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """A random weight encoded in NVFP4, written with its global scale."""
        stem, (rows, cols) = weight.removesuffix("weight"), shape
        held = (rows, cols // PER_BYTE * PER_BYTE)  # the values the packed bytes hold
        others = (weight, stem + "weight_scale", stem + "input_scale")
        return {stem + "weight_scale_2": Example(NVFP4_MODELOPT, held, others)}

    def weight_shape(
        self, weight: str, shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[int, ...] | None:
        """[N, K] of the weight stored under its own name as [N, K/2] bytes."""
        return self.unpacked_shape(weight, shapes, weight, PER_BYTE)

    def skips(self, layer: str, *parts: str) -> bool:
        """Whether vLLM leaves a layer unquantized (`is_layer_excluded`)."""
        return excluded(self.excluded, layer, *parts)

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """The packed weight and its group scales, cut as the weight in whole bytes and
        groups, then one of each scalar per part (per expert and part of a stack)."""

        def packed(suffix: str, per: int) -> tuple[Piece, ...]:
            return tuple(
                Piece(
                    p.source.removesuffix("weight") + suffix,
                    Cut.PACKED,
                    expert=p.expert,
                    scale_of=ScaleOf(
                        matrix(shapes[p.source], p.source), p.cut, (1, per), None, p.heads
                    ),
                )
                for p in pieces
            )

        stem = name.removesuffix("weight")
        params: list[tuple[str, tuple[Piece, ...], str | None]] = [
            (name, packed("weight", PER_BYTE), BYTE),
            (stem + "weight_scale", packed("weight_scale", self.group), E4M3),
        ]
        for scalar in SCALARS:
            of = tuple(
                Piece(p.source.removesuffix("weight") + scalar, Cut.PER_TENSOR, expert=p.expert)
                for p in pieces
            )
            params.append((stem + scalar, of, F32))
        return params, {}

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """vLLM's `KNvfp4Static.create_weights` refusal of a linear layer, in its words;
        experts whose sizes are not whole groups (vLLM's stacks are [.., size // 16])."""
        if layer.kind == "experts":
            local = layer.outputs[0][0] // moe_ways
            for what, size in (("hidden_size", layer.input), ("intermediate size per rank", local)):
                if size % self.group:
                    return [
                        f"{layer.name}: NVFP4 MoE stores the {what} ({size}) in groups of "
                        f"{self.group}, which it does not divide."
                    ]
            return []
        size = layer.input // tp if layer.kind == "row" else layer.input
        if size % self.group == 0:
            return []
        return [
            f"{layer.name}: Unsupported model when in features size is not multiple of "
            f"{self.group} ({size} input features on a rank)."
        ]


def excluded(patterns: tuple[str, ...], layer: str, *parts: str) -> bool:
    """vLLM's `is_layer_excluded` of a layer named `layer` (a fused layer's checkpoint
    parts in `parts`), with `patterns` already expanded (`expand`): a FusedMoE layer is
    excluded by any pattern naming experts that contains its name; a fused layer by its
    own name or its parts'; any layer by its name, a pattern inside its name, or a
    wildcard."""
    if "experts" in layer:
        exact = any(layer in pattern for pattern in patterns if "experts" in pattern)
    else:
        exact = layer in patterns or (bool(parts) and all(part in patterns for part in parts))
    if exact or any(pattern != layer and pattern in layer for pattern in patterns):
        return True
    return any(fnmatch(layer, pattern) for pattern in patterns)


def expand(patterns: list[str]) -> tuple[str, ...]:
    """vLLM's `apply_vllm_mapper` rewriting: `name*` (no dot before the star) becomes
    `name` and `name.*`."""
    out: list[str] = []
    for pattern in patterns:
        if len(pattern) >= 2 and pattern[-1] == "*" and pattern[-2] != ".":
            out += [pattern[:-1], pattern[:-1] + ".*"]
        else:
            out.append(pattern)
    return tuple(out)


def is_modelopt(quant: Config) -> bool:
    return str(quant.get("quant_method", "")).lower().startswith("modelopt")


def modelopt_quant(quant: Config) -> ModeloptNvfp4:
    """The scheme of a ModelOpt `quantization_config` (config.json's, with `quant_algo`
    at the top, or the older one with a `quantization` section); one it cannot lay out
    comes back with its `problem` set."""
    section = quant.get("quantization")
    if isinstance(section, Mapping):
        algo, kv_cache = section.get("quant_algo"), section.get("kv_cache_quant_algo")
        group, exclude = section.get("group_size"), section.get("exclude_modules", [])
        lacking = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules")
                   if k not in section]  # fmt: skip
        if "NVFP4" in str(algo).upper() and lacking:
            return ModeloptNvfp4(
                f"NVFP4 quantization requires the following fields in hf_quant_config.json: "
                f"{lacking}"
            )
    else:
        algo, group, exclude = (
            quant.get("quant_algo"),
            quant.get("group_size"),
            quant.get("ignore", []),
        )
        scheme = quant.get("kv_cache_scheme")
        kv_cache = "FP8" if isinstance(scheme, Mapping) and scheme.get("num_bits") == 8 else None
    algo = str(algo or "").upper()
    if algo == "NVFP4" and _weights_only(quant.get("config_groups")):
        algo = "W4A16_NVFP4"  # as vLLM reads a checkpoint whose groups quantize no input
    why = ""
    if algo != "NVFP4":
        why = f"quant_algo {algo or None!r}"
    elif group not in (None, GROUP):
        why = f"group_size {group!r}"
    elif kv_cache:
        why = f"KV-cache quantization {kv_cache!r}"
    elif not isinstance(exclude, list) or not all(isinstance(n, str) for n in exclude):
        why = "an exclude list that is not a list of names"
    if why:
        return ModeloptNvfp4(f"quantization_config is ModelOpt with {why}; {SUPPORTED}")
    return ModeloptNvfp4(excluded=expand(exclude))


def _weights_only(groups: Any) -> bool:
    return (
        isinstance(groups, Mapping)
        and bool(groups)
        and all(
            isinstance(g, Mapping) and g.get("input_activations") is None for g in groups.values()
        )
    )
