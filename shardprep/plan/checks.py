"""What keeps a conversion from being planned: each model checked against its family's
rules before any layout is used, every problem collected and reported at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardprep.errors import ConfigError, summarize
from shardprep.plan import archs
from shardprep.plan.topology import Topology

if TYPE_CHECKING:
    from shardprep.plan.make import SourceModel


def dp_problems(dp: int, expert_parallel: bool) -> list[str]:
    if dp > 1 and not expert_parallel:
        return [
            f"--dp {dp} without --enable-expert-parallel cuts every expert tp x dp ways, "
            "which shardprep does not lay out yet; add --enable-expert-parallel"
        ]
    return []


def checked_layout(
    role: str,
    family: archs.Family,
    source: SourceModel,
    tp: int,
    topology: Topology | None,
    context: dict[str, Any],
) -> tuple[archs.Layout | None, list[str]]:
    """Problems of one model; its layout when there are none and the topology is valid."""
    layers = source.config.get("num_hidden_layers")
    if isinstance(layers, (int, float)) and layers > len(source.tensors):
        # Every layer has tensors: bound all work by the tensors actually present.
        return None, [
            f"{role}: config.json says num_hidden_layers={layers} but the checkpoint holds "
            f"only {len(source.tensors)} tensors; fix config.json"
        ]
    try:
        problems = [f"{role}: {p}" for p in family.check(source.config, tp, **context)]
        expected = family.expected_shapes(source.config, **context)
    except ConfigError as exc:
        return None, [f"{role}: {exc}"]
    except (KeyError, ValueError, TypeError) as exc:
        return None, [f"{role}: config.json lacks or garbles {exc}"]
    if topology is None:
        return None, problems
    shapes = {name: shape for name, (_, shape) in source.tensors.items()}
    for name, shape in sorted(shapes.items()):
        if name in expected and tuple(expected[name]) != shape:
            problems.append(
                f"{role}: {name} has shape {list(shape)} but config.json implies "
                f"{list(expected[name])}"
            )
    layout = family.layout(source.config, shapes, topology, **context)
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


def problem_summary(problems: list[str], limit: int = 8) -> str:
    head = "; ".join(problems[:limit])
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"cannot convert: {head}{more}"
