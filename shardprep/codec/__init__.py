"""Transport compression for safetensors files: a registry of codecs by name.

``"none"`` is the identity (the file itself). ``"zstd"`` is the framed container of
`container`, each frame's tensors byte-grouped and entropy-coded as `transforms` says
(the numbers it stores in `stored`, the float words rebuilt by `reassembly`). The codecs
are registered in `builtin` (`registry`); files and buffers are compressed and restored
by `files`, which says how frames, threads and memory go.
"""

from __future__ import annotations

from shardprep.codec import builtin as builtin  # registers "none" and "zstd"
from shardprep.codec.container import DEFAULT_FRAME_SIZE, MAX_FRAME_SIZE, MIN_FRAME_SIZE
from shardprep.codec.files import CodecResult, compress_file, decompress_buffer, decompress_file
from shardprep.codec.registry import Codec, codec_names, get_codec, register_codec

__all__ = [
    "DEFAULT_FRAME_SIZE",
    "MAX_FRAME_SIZE",
    "MIN_FRAME_SIZE",
    "Codec",
    "CodecResult",
    "codec_names",
    "compress_file",
    "decompress_buffer",
    "decompress_file",
    "get_codec",
    "register_codec",
]
