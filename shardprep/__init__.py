"""shardprep: pre-shard checkpoints for vLLM, load them rank-locally with no collective."""

from shardprep.errors import (
    ConfigError,
    CorruptFileError,
    ManifestError,
    PlanError,
    ShardprepError,
    TopologyMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CorruptFileError",
    "ManifestError",
    "PlanError",
    "ShardprepError",
    "TopologyMismatchError",
    "__version__",
]
