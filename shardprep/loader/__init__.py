"""The runtime side: a rank-local reader, and the vLLM plugin (`shardprep.loader.plugin`,
imported only by vLLM through its `vllm.general_plugins` entry point)."""

from shardprep.loader.reader import (
    MissingRankFileError,
    backend_in_use,
    check_rank_files,
    read_rank,
)

__all__ = ["MissingRankFileError", "backend_in_use", "check_rank_files", "read_rank"]
