"""What keeps a conversion from being planned: each model checked against its family's
rules before any layout is used, every problem collected and reported at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardprep.errors import ConfigError, summarize
from shardprep.format.dtypes import FLOAT_DTYPES, keeps_values
from shardprep.format.records import Topology
from shardprep.format.request import ConversionRequest
from shardprep.format.vllm_layout import expert_substitution
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Family,
    Layout,
    PlanContext,
)
from shardprep.plan.archs.parts import quantized
from shardprep.plan.cuts import MODEL_DTYPE
from shardprep.plan.drafts import with_target_rules
from shardprep.plan.quant import Mxfp4Quant, scheme_of
from shardprep.plan.records import SourceModel

UNPROVEN = "shardprep's layout of them is not proven against vLLM"


def dp_problems(dp: int, expert_parallel: bool) -> list[str]:
    if dp > 1 and not expert_parallel:
        return [
            f"--dp {dp} without --enable-expert-parallel cuts every expert tp x dp ways, "
            "which shardprep does not lay out yet; add --enable-expert-parallel"
        ]
    return []


def checked_layout(
    role: str,
    family: Family,
    source: SourceModel,
    tp: int,
    topology: Topology | None,
    ctx: PlanContext,
) -> tuple[Layout | None, list[str]]:
    """Problems of one model; its layout when there are none and the topology is valid."""
    refused = loading_problems(source.config, family)
    if refused:
        return None, [f"{role}: {p}" for p in refused]
    try:
        counted = count_problems(family, source, ctx)
    except ConfigError as exc:
        return None, [f"{role}: {exc}"]
    except (KeyError, ValueError, TypeError) as exc:
        return None, [f"{role}: config.json lacks or garbles {exc}"]
    if counted:
        return None, [f"{role}: {p}" for p in counted]
    try:
        problems = [f"{role}: {p}" for p in family.check(source.config, tp, ctx)]
        expected = quantized.expected_shapes(family, source.config, ctx)
    except ConfigError as exc:
        return None, [f"{role}: {exc}"]
    except (KeyError, ValueError, TypeError) as exc:
        return None, [f"{role}: config.json lacks or garbles {exc}"]
    if topology is None:
        return None, problems
    shapes = source.shapes
    differ = sorted(n for n, want in expected.items() if n in shapes and tuple(want) != shapes[n])
    for name in differ:
        problems.append(
            f"{role}: {name} has shape {list(shapes[name])} but config.json implies "
            f"{list(expected[name])}"
        )
    layout = quantized.layout(family, source.config, shapes, topology, ctx)
    layout = with_target_rules(family, source.config, shapes, topology, layout, ctx)
    if not problems:
        refused = quantized.quantization_problems(family, source.config, layout, shapes, tp, ctx)
        problems += [f"{role}: {p}" for p in refused]
    problems += [f"{role}: {p}" for p in dtype_problems(layout, source, family)]
    consumed = {piece.source for param in layout.params for piece in param.pieces}
    unknown = sorted(set(shapes) - consumed - set(layout.skipped))
    if unknown:
        problems.append(
            f"{role}: {len(unknown)} tensor(s) that shardprep does not know where to put: "
            f"{summarize(unknown)}"
        )
    missing = sorted(set(expected) - set(shapes) - set(layout.optional_sources))
    if missing:
        problems.append(
            f"{role}: {len(missing)} tensor(s) that config.json implies are missing: "
            f"{summarize(missing)}"
        )
    return layout, problems


def count_problems(family: Family, source: SourceModel, ctx: PlanContext) -> list[str]:
    """The first count of config.json that is more than the checkpoint's headers can hold,
    found before any hook enumerates it: every layer and every counted unit has tensors
    (or rows of a stacked tensor) of its own, so the tensors present bound all later work."""
    held = len(source.tensors)
    layers = source.config.get("num_hidden_layers")
    if isinstance(layers, (int, float)) and layers > held:
        return [
            f"config.json says num_hidden_layers={layers} but the checkpoint holds only "
            f"{held} tensors; fix config.json"
        ]
    for count in family.counts(source.config, ctx):
        stacked = [shape[0] for s in count.stacks if (shape := source.tensors.get(s, ("", ()))[1])]
        if stacked and count.value > max(stacked):
            return [
                f"config.json says {count.key}={count.value}, but the checkpoint's stacked "
                f"tensors ({count.stacks[0]} ...) hold at most {max(stacked):,}; fix config.json"
            ]
        if count.tensors > held or (count.stacks and not stacked and count.value > held):
            return [
                f"config.json says {count.key}={count.value}, which needs more tensors than "
                f"the {held:,} the checkpoint holds; fix config.json"
            ]
    return []


def counts_fit(family: Family, source: SourceModel) -> bool:
    """Whether config.json's counts fit the checkpoint's headers, so that the family's
    hooks may enumerate them (else planning says which does not)."""
    try:
        return not count_problems(family, source, DEFAULT_CONTEXT)
    except (ConfigError, KeyError, ValueError, TypeError):
        return False


def dtype_problems(layout: Layout, source: SourceModel, family: Family) -> list[str]:
    """A parameter that follows the model dtype is floating point in vLLM: its source
    must be too, or quantized as the family declares (`source_dtypes`); a parameter of a
    fixed dtype (fp8 weights, float32 scales, int32 packed weights) takes only a source
    whose values a copy into it keeps."""
    declared: dict[str, str] | None = None  # asked only of a source that is not floating
    kept: dict[tuple[str, str], bool] = {}
    problems = []
    for param in layout.params:
        for piece in param.pieces:
            entry = source.tensors.get(piece.source)  # an absent one is reported apart
            if entry is None:
                continue
            dtype = entry[0]
            if param.dtype is None:
                if dtype in FLOAT_DTYPES:
                    continue
                if declared is None:
                    declared = quantized.source_dtypes(family, source.config)
                if declared.get(piece.source) != dtype:
                    problems.append(
                        f"{piece.source} is {dtype} in the checkpoint, but vLLM holds "
                        f"{param.name} as a floating-point parameter; use a checkpoint whose "
                        "weights are floating point"
                    )
            elif param.dtype != MODEL_DTYPE and not _keeps(kept, dtype, param.dtype):
                problems.append(
                    f"{piece.source} is {dtype} in the checkpoint, but vLLM holds {param.name} "
                    f"as {param.dtype}, and a copy into it would change its values; use a "
                    f"checkpoint that stores {piece.source} as {param.dtype}"
                )
    return problems


def _keeps(kept: dict[tuple[str, str], bool], source: str, param: str) -> bool:
    if (source, param) not in kept:
        kept[source, param] = keeps_values(source, param)
    return kept[source, param]


def loading_problems(config: Mapping[str, Any], family: Family) -> list[str]:
    """What a copy-into-parameter loader cannot serve, whatever the topology: a
    quantization the family does not place, and experts that vLLM would substitute."""
    problems = []
    scheme = scheme_of(config)
    if scheme is not None and scheme.problem:
        problems.append(scheme.problem)
    elif scheme is not None and scheme.name not in family.quant_schemes:
        why = family.quant_refusals.get(scheme.name) or family.quant_refusals.get("*")
        problems.append(
            f"{scheme.method} checkpoints ({scheme.name}) of the {family.name} family are not "
            f"supported yet: {why or UNPROVEN}; convert an unquantized checkpoint"
        )
    substituted = expert_substitution(config)
    if substituted:
        problems.append(
            f"config.json asks vLLM to substitute experts ({substituted}), which drops "
            "experts from the stacks that an artifact stores whole; remove it from config.json"
        )
    return problems


def problem_summary(problems: list[str], limit: int = 8) -> str:
    """One line of every problem once: a draft inside the target checkpoint repeats the
    target's problems of the same config.json (`role: ...`), which are left out."""
    unrepeated: dict[str, str] = {}
    for problem in problems:
        unrepeated.setdefault(problem.removeprefix("target: ").removeprefix("draft: "), problem)
    problems = list(unrepeated.values())
    head = "; ".join(problems[:limit])
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"cannot convert: {head}{more}"


def request_problems(target: SourceModel, request: ConversionRequest) -> list[str]:
    """What in the request itself keeps it from being planned."""
    problems = []
    stage, pp = request.stage, request.pp
    if stage is not None and not 0 <= stage < pp:
        problems.append(f"--stage {stage} is outside the pipeline stages 0..{pp - 1}")
    problems += dp_problems(request.dp, request.expert_parallel)
    pad = request.mxfp4_pad
    if pad is not None and not isinstance(scheme_of(target.config), Mxfp4Quant):
        problems.append(
            f"--mxfp4-pad {pad} matters only to MXFP4 checkpoints (quant_method mxfp4); "
            "leave it out"
        )
    return problems


def expert_flag_problems(
    architecture: str, request: ConversionRequest, layouts: list[Layout | None]
) -> list[str]:
    """Expert-parallel flags given for a model without experts."""
    if any(layout and layout.num_experts for layout in layouts):
        return []
    problems = []
    if request.expert_parallel:
        problems.append(
            f"--enable-expert-parallel needs a mixture-of-experts model; {architecture} has "
            "no experts, so leave the flag out"
        )
    if request.dp > 1:
        problems.append(
            f"--dp {request.dp} matters only to a mixture-of-experts model; {architecture} "
            "has no experts and is the same on every data-parallel rank, so leave --dp out"
        )
    return problems
