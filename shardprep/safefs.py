"""Writes that stay inside the folder they are meant for.

A folder shardprep writes into may hold names someone else planted: a symbolic link where a
temporary file, the lock or a copied config goes. Opening such a name for writing would
write through the link, to a file outside the folder. Every file shardprep creates is
therefore opened with `O_NOFOLLOW` and `O_EXCL` (a stale name of ours is removed first:
`unlink` removes a link, never what it points to), or made by `mkstemp` in the same folder,
and takes the mode the umask gives, like any other file the user creates.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from shardprep.constants import INCOMPLETE_SUFFIX
from shardprep.errors import OutputExistsError
from shardprep.pieces import WRITE_PIECE

_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def umask() -> int:
    """The process's umask (read from /proc where it can be, else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def create_new(path: Path, mode: int = 0o666, *, read: bool = False) -> int:
    """A new empty file at `path`, open for writing (and reading with `read`): whatever
    stood at that name before (a stale temporary file, a planted link) is removed first,
    and the name is then created, never followed."""
    path = Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise OutputExistsError(
            f"{path} is a folder where shardprep writes a file; remove it"
        ) from None
    flags = _NEW | (os.O_RDWR if read else os.O_WRONLY)
    return os.open(path, flags, mode)


def write_new(path: Path, data: bytes, mode: int = 0o666) -> None:
    """`data` into a new file at `path` (see `create_new`)."""
    fd = create_new(path, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def write_atomic(
    path: Path, data: bytes | str, *, prefix: str | None = None, suffix: str = INCOMPLETE_SUFFIX
) -> None:
    """`data` at `path` through a unique temporary name in the same folder, then a rename:
    concurrent writers never mix their bytes and a planted link is replaced, not followed.
    The file gets the mode the umask gives (mkstemp alone makes it 0600)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix or f".{path.name}.", suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_existing(path: Path, data: str) -> None:
    """`data` appended to the file at `path`, which must exist and not be a link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        view = memoryview(data.encode())
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def copy_new(src: Path, dst: Path) -> None:
    """Copy `src` (which may be a link, as in the Hugging Face cache) to a new file `dst`."""
    fd = create_new(dst)
    with open(src, "rb") as source, os.fdopen(fd, "wb") as target:
        shutil.copyfileobj(source, target, WRITE_PIECE)


def refuse_linked_folders(root: Path, names: tuple[str, ...]) -> None:
    """Refuse to write under `root` when one of the folders `names` (relative paths whose
    components are checked one by one) is a symbolic link: it leads outside `root`."""
    for name in names:
        path = Path(root)
        for part in Path(name).parts:
            path = path / part
            if path.is_symlink():
                raise OutputExistsError(
                    f"{path} is a symbolic link; shardprep writes only inside {root}. "
                    "Remove the link (or choose another folder) and rerun"
                )
