"""The skeleton of DeepSeek-style MTP drafts (DeepSeek-V3, GLM-4.5, Kimi-K3): the MTP
layers a checkpoint keeps after its decoder layers, each a decoder layer with its own
`enorm`, `hnorm`, `eh_proj` and `shared_head`.
"""

from __future__ import annotations

from collections.abc import Collection

from shardprep.errors import ConfigError
from shardprep.plan.archs.base import BuiltinDraft, Config

BLOCK = "mtp_block."  # vLLM's prefix of the decoder layer inside an MTP layer
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
HEAD = "shared_head.head.weight"
# Decoder layers from num_hidden_layers on, which vLLM loads only as the MTP draft.
MTP_LAYERS = BuiltinDraft(
    "mtp",
    held="an MTP layer, which the MTP draft holds",
    left_out="an MTP layer; vLLM loads it only as the MTP draft, which --no-mtp or another "
    "--draft leaves out",
)


def mtp_layers(config: Config) -> range:
    """The MTP layers of a checkpoint that keeps them after its decoder layers."""
    first = int(config["num_hidden_layers"])
    return range(first, first + int(config.get("num_nextn_predict_layers") or 0))


def require_mtp_layer(
    names: Collection[str] | None, prefix: str, layer: int, config: Config
) -> None:
    """One line when config.json promises MTP layer `layer` (tensors `prefix`*) that the
    checkpoint's tensor `names` lack; nothing when the names are not known yet."""
    if names is not None and not any(n.startswith(prefix) for n in names):
        raise ConfigError(
            f"config.json says num_nextn_predict_layers={config['num_nextn_predict_layers']} "
            f"but the checkpoint holds no tensor of MTP layer {layer} ({prefix}*); convert "
            "with --no-mtp to leave the MTP draft out, or use a checkpoint that includes its "
            "MTP layers"
        )
