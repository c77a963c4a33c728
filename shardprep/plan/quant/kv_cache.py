"""KV-cache scales that an fp8 checkpoint ships (`k_scale`, `v_scale`, ...), placed where
vLLM's weight mapper for fp8 (`Fp8Config.get_cache_scale_mapper`, applied by
`AutoWeightsLoader` before any model's `load_weights`) puts them: the attention layer's
0-d `attn.{q,k,v}_scale` (`KVCacheScaleParameter`) in the model's dtype, the same on every
rank. A
checkpoint without them leaves vLLM's -1 in place (`never_loaded`).

The names are vLLM's, not a family's: any attention layer whose parameters a layout holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from shardprep.plan.cuts import MODEL_DTYPE, Cut, Piece

# vLLM creates them (`torch.tensor(-1.0)`) while the model's dtype is torch's default.
SCALE_DTYPE = MODEL_DTYPE
# vLLM's mapping, first match wins (fp8's suffixes, then the base regexes in their order).
MAPPING: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.k_proj\.output_scale$"), ".attn.k_scale"),
    (re.compile(r"\.v_proj\.output_scale$"), ".attn.v_scale"),
    (re.compile(r"\.q_proj\.output_scale$"), ".attn.q_scale"),
    (re.compile(r"\.self_attn\.prob_output_scale$"), ".self_attn.attn.prob_scale"),
    (re.compile(r"\.kv_scale$"), ".attn.k_scale"),
    (re.compile(r"\.self_attn\.[kv]_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"\.self_attn\.qk(?:qk)?v_proj\.([kv])_scale$"), r".self_attn.attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
)


def vllm_name(source: str) -> str | None:
    """The KV-cache scale parameter vLLM loads `source` into, or None."""
    for pattern, replacement in MAPPING:
        if pattern.search(source):
            return pattern.sub(replacement, source)
    return None


def kv_cache_params(
    sources: Iterable[str], params: Iterable[tuple[str, tuple[int, ...]]]
) -> list[tuple[str, Piece, tuple[int, ...]]]:
    """(parameter, piece, stages) for each KV-cache scale among `sources` whose attention
    layer has parameters among `params` ((name, stages)); others stay unplaced."""
    stages: dict[str, tuple[int, ...]] = {}
    for name, on in params:
        module = name.rsplit(".", 2)[0] + "."  # `...self_attn.` of `...self_attn.x.weight`
        stages.setdefault(module, on)
    found: dict[str, tuple[str, Piece, tuple[int, ...]]] = {}
    for source in sorted(sources):
        scale = vllm_name(source)
        if scale is None:
            continue
        layer = scale.rsplit(".attn.", 1)[0] + "."
        if layer in stages and scale not in found:
            found[scale] = (scale, Piece(source, Cut.SCALAR), stages[layer])
    return list(found.values())


def shipped(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The checkpoint's tensors that vLLM reads as KV-cache scales."""
    return [name for name in shapes if vllm_name(name) is not None]
