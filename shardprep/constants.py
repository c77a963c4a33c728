"""File names, patterns, limits and environment variables, in one place."""

from __future__ import annotations

import os
from pathlib import Path

FORMAT = "shardprep/1"

MANIFEST_NAME = "shardprep.json"
# Where every rank tensor's parts came from: read only to serve another topology.
REGIONS_NAME = "shardprep.regions.json"
SHARDS_DIR = "shards"
DRAFT_DIR = "draft"
SHARD_PATTERN = "model-pp-{pp}-tp-{tp}-part-{part}.safetensors"
# With data parallelism the routed experts differ per dp rank: they go to files of their
# own, read only by that (stage, tp rank, dp rank); the rest stays shared in SHARD_PATTERN.
DP_SHARD_PATTERN = "model-pp-{pp}-tp-{tp}-dp-{dp}-part-{part}.safetensors"
# The same pattern, spelled as vLLM's sharded_state loader expects it.
VLLM_SHARDED_STATE_PATTERN = "shards/model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
PARTIAL_MARKER = ".shardprep-partial.json"
INCOMPLETE_SUFFIX = ".incomplete"
LOCK_NAME = ".shardprep-lock"
# The private folder of a convert with --source-budget, removed when it ends.
SOURCE_DOWNLOAD_DIR = ".source-download"
SOURCE_PARTIAL_DIR = "partial"  # in it: the files being downloaded, by sha256
# A fetched folder's own state (markers, locks, staging), beside the files it holds.
STATE_DIR = ".shardprep"
# The manifest as fetch downloaded it, in STATE_DIR: what makes a folder a fetched one.
FETCHED_MANIFEST = "manifest.json"

MAX_HEADER_BYTES = 100_000_000
MAX_JSON_BYTES = 100_000_000  # a model index or a manifest
MAX_SIDE_FILE_BYTES = 64 * 1024**2  # a draft's .pt side file (a mask embedding)
DEFAULT_MAX_PART_BYTES = 5 * 1024**3
CHUNK_BYTES = 64 * 1024**2
VOCAB_PADDING = 64

# Files copied from a source model folder next to the shards.
COPIED_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "preprocessor_config.json",
)

# Files a draft folder may carry besides its config and tokenizer: tensors a draft keeps
# outside safetensors (DFlash's mask embedding). Each draft family names its own.
DRAFT_SIDE_FILES = ("mask_embedding.pt",)

ENV_CACHE = "SHARDPREP_CACHE"
ENV_DEBUG = "SHARDPREP_DEBUG"
ENV_PP_PARTITION = "VLLM_PP_LAYER_PARTITION"
ENV_ALLOW_UNVERIFIED_VLLM = "SHARDPREP_ALLOW_UNVERIFIED_VLLM"


def debug_enabled() -> bool:
    """SHARDPREP_DEBUG set to anything but empty, 0, false, no or off (any case)."""
    return os.environ.get(ENV_DEBUG, "").strip().lower() not in ("", "0", "false", "no", "off")


def unverified_vllm_allowed() -> bool:
    return os.environ.get(ENV_ALLOW_UNVERIFIED_VLLM, "").lower() in ("1", "true", "yes", "on")


def pp_partition_from_env() -> str | None:
    return os.environ.get(ENV_PP_PARTITION) or None


def cache_root() -> Path:
    """SHARDPREP_CACHE, else `shardprep` under the Hugging Face cache home."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    from huggingface_hub import constants as hf_constants

    return Path(hf_constants.HF_HOME) / "shardprep"
