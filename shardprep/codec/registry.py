"""The codecs by name: a codec declares its name and the magic bytes that open every file
it writes (b"" for the identity), and registers itself with `register_codec`. A file is
recognised by its first bytes (`detect_codec`); a plain safetensors file is "none"."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from shardprep.codec.streams import HashingReader, HashingWriter
from shardprep.constants import MAX_HEADER_BYTES
from shardprep.errors import ConfigError, CorruptFileError


class Codec(Protocol):
    """A transport codec: `magic` opens every file it writes (b"" for the identity)."""

    name: str
    magic: bytes

    def compress(
        self, path: Path, src: HashingReader, dst: HashingWriter, *, threads: int, frame_size: int
    ) -> None:
        """Write the stored form of the safetensors file `path` (read through `src`)."""

    def decompress(
        self,
        src: HashingReader,
        dst: HashingWriter,
        *,
        threads: int,
        expected: int | None,
        stored_size: int,
    ) -> bytes | None:
        """Write the raw bytes read from `src` to `dst` (at most `expected` bytes, when given);
        return the raw sha256 the stored file promises, if any."""


_CODECS: dict[str, Codec] = {}
_C = TypeVar("_C", bound=Codec)


def register_codec(name: str) -> Callable[[type[_C]], type[_C]]:
    """Class decorator: register a codec under `name`. Registering again is a no-op."""

    def wrap(cls: type[_C]) -> type[_C]:
        known = _CODECS.get(name)
        if known is None or type(known).__qualname__ != cls.__qualname__:
            _CODECS[name] = cls()
        return cls

    return wrap


def codec_names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_CODECS)


def get_codec(name: str) -> Codec:
    """The codec registered as `name`; a miss lists the choices."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ConfigError(
            f"Unknown codec {name!r}; choose one of: {', '.join(codec_names())}."
        ) from None


def detect_codec(head: bytes) -> Codec:
    """The codec of a file whose first 8 bytes are `head`: the one whose magic opens it,
    else "none" if they read as a safetensors header length."""
    for impl in _CODECS.values():
        if impl.magic and head.startswith(impl.magic):
            return impl
    if len(head) == 8 and struct.unpack("<Q", head)[0] <= MAX_HEADER_BYTES:
        return get_codec("none")
    raise CorruptFileError(
        f"it is neither a shardprep container nor a safetensors file (starts {head!r})"
    )
