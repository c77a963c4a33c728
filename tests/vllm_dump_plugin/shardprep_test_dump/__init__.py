"""Test-only vLLM plugin: the load format ``dump-default``.

It loads exactly as vLLM's ``DefaultModelLoader`` does and, right after
``load_weights`` (before ``process_weights_after_loading``), saves every parameter of
the rank to ``$SHARDPREP_DUMP_DIR/{role}-pp{P}-tp{T}.safetensors``. With
``$SHARDPREP_LOAD_TIMES`` set (benchmarks), it also times every rank's ``load_weights``
of the default loader, ``sharded_state`` and ``sharded-fast`` (see timing.py). With
``$SHARDPREP_STUB_KERNELS=1``, quantized layers whose kernel the CPU build cannot choose
get a stand-in kernel (see kernels.py); with ``$SHARDPREP_STUB_SPARSE_ATTENTION=1``,
sparse attention layers (DeepSeek-V3.2) get the CPU MLA backend (see sparse.py).

Importing this package does not import vLLM; ``register`` does, and is idempotent.
"""

from __future__ import annotations

DUMP_FORMAT = "dump-default"
DUMP_SHARDED_FAST_FORMAT = "dump-sharded-fast"
DUMP_DIR_ENV = "SHARDPREP_DUMP_DIR"
# "1": every collective fails while the rank loads (see trap.py), and the dump records
# the calls that were refused.
TRAP_ENV = "SHARDPREP_TRAP_COLLECTIVES"
TIMES_ENV = "SHARDPREP_LOAD_TIMES"

__all__ = [
    "DUMP_DIR_ENV",
    "DUMP_FORMAT",
    "DUMP_SHARDED_FAST_FORMAT",
    "TIMES_ENV",
    "TRAP_ENV",
    "register",
]


def register() -> None:
    """Entry point of ``vllm.general_plugins``: add the ``dump-default`` load format, and
    time the loaders when ``$SHARDPREP_LOAD_TIMES`` is set."""
    from vllm.model_executor import model_loader

    from shardprep_test_dump import kernels, sparse, timing

    kernels.install()
    sparse.install()
    timing.install()

    registered = model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    if DUMP_FORMAT in registered:
        return
    from shardprep_test_dump.loader import DumpDefaultLoader, DumpShardedFastLoader

    model_loader.register_model_loader(DUMP_FORMAT)(DumpDefaultLoader)
    model_loader.register_model_loader(DUMP_SHARDED_FAST_FORMAT)(DumpShardedFastLoader)
