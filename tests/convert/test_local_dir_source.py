"""A source folder fetched by `hf download --local-dir`: the sha256 huggingface_hub recorded
beside each file is trusted the way huggingface_hub itself trusts it, checked on request.

The folders are downloaded with the real huggingface_hub client from the test Hub
(tests/support/hub_server.py); stale or forged metadata is written with huggingface_hub's own
writer and read back with its own reader, so both sides agree on the format.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hub_server import HubServer
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub._local_folder import read_download_metadata, write_download_metadata

from shardprep.constants import MANIFEST_NAME
from shardprep.convert.checkpoint import local_dir_sha256
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_model
from shardprep.errors import CorruptFileError

# The client's own LFS PUT passes a file object as `data=`, which httpx2 deprecates.
pytestmark = [
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/local-dir"


@pytest.fixture
def downloaded(hub: HubServer, tmp_path: Path) -> tuple[Path, Path]:
    """(the model as written, the same model fetched with `snapshot_download(local_dir=)`)."""
    model = make_tiny_model(tmp_path / "model", torch_dtype="bfloat16", files=2)
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=model)
    local = tmp_path / "local"
    snapshot_download(REPO, local_dir=local, endpoint=hub.endpoint)
    return model, local


def _weights(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def _source_hashes(out: Path, options: Options, source: Path) -> list[tuple[str, str | None]]:
    manifest = convert(str(source), out, options, progress=False)
    return [(f.path, f.sha256) for f in manifest.model("target").source.files]


def test_recorded_sha256_is_trusted_and_rows_move_in_the_kernel(
    downloaded: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, local = downloaded
    names = _weights(local)
    assert len(names) == 2
    for name in names:  # what huggingface_hub recorded is the real sha256, and it says so
        real = hashlib.sha256((local / name).read_bytes()).hexdigest()
        assert read_download_metadata(local, name).etag == real
        assert local_dir_sha256(local, name) == real
    kernel_copies: list[tuple[int, int, int]] = []  # (source inode, rank file inode, offset)
    real_copy = os.copy_file_range

    def copy(*a: int) -> int:
        kernel_copies.append((os.fstat(a[0]).st_ino, os.fstat(a[1]).st_ino, a[4]))
        return real_copy(*a)

    monkeypatch.setattr(os, "copy_file_range", copy)
    options = Options(tp=2, pp=2)
    from_local = convert(str(local), tmp_path / "local-out", options, progress=False)
    assert kernel_copies, "whole-row slices should go file to file, in the kernel"
    # ...and in the order of their destinations, whichever source file holds them, so that
    # each rank file's prefix grows (and is hashed) tensor by tensor: in file order, o_proj
    # and the MLP (after q/k/v in the source's sorted names) would land past qkv_proj, which
    # its v_proj completes last, and a v_proj in the next file would hold back the rest.
    assert len({source for source, _, _ in kernel_copies}) == 2
    per_file: dict[int, list[int]] = {}
    for _, rank_file, offset in kernel_copies:
        per_file.setdefault(rank_file, []).append(offset)
    assert all(offsets == sorted(offsets) for offsets in per_file.values()), per_file
    copied_from_local = len(kernel_copies)
    plain = convert(str(model), tmp_path / "plain-out", options, progress=False)
    # A plain folder is hashed here (whole, on another thread) and still copied in the
    # kernel; the sha256 it records is the real one (what huggingface_hub recorded, above).
    assert len(kernel_copies) == 2 * copied_from_local
    assert [(f.path, f.sha256) for f in from_local.files] == [
        (f.path, f.sha256) for f in plain.files
    ]
    assert [(f.path, f.sha256) for f in from_local.model("target").source.files] == [
        (f.path, f.sha256) for f in plain.model("target").source.files
    ]
    assert verify(tmp_path / "local-out", full=True).ok


def test_wrong_recorded_sha256_is_caught_by_rehash_source(
    downloaded: tuple[Path, Path], tmp_path: Path
) -> None:
    _, local = downloaded
    name = _weights(local)[0]
    write_download_metadata(local, name, commit_hash="c" * 40, etag="0" * 64)
    assert read_download_metadata(local, name).etag == "0" * 64  # huggingface_hub trusts it
    hashes = dict(_source_hashes(tmp_path / "a", Options(tp=2, pp=1), local))
    assert hashes[name] == "0" * 64
    with pytest.raises(CorruptFileError, match=r"not to the sha256 recorded when it was down"):
        convert(str(local), tmp_path / "b", Options(tp=2, pp=1, rehash_source=True), progress=False)
    assert not (tmp_path / "b" / MANIFEST_NAME).exists()


def test_file_changed_after_download_is_hashed(
    downloaded: tuple[Path, Path], tmp_path: Path
) -> None:
    _, local = downloaded
    name = _weights(local)[0]
    path = local / name
    write_download_metadata(local, name, commit_hash="c" * 40, etag="0" * 64)
    later = read_download_metadata(local, name).timestamp + 5
    os.utime(path, (later, later))  # modified after the metadata was written
    assert read_download_metadata(local, name) is None  # huggingface_hub would re-hash it
    assert local_dir_sha256(local, name) is None
    hashes = dict(_source_hashes(tmp_path / "out", Options(tp=2, pp=1), local))
    assert hashes[name] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "lines",
    [
        "c\n" + "1" * 40 + "\n{now}\n",  # a git sha1 etag: a regular (non-LFS) file
        "c\n" + "A" * 64 + "\n{now}\n",  # not lowercase hex
        "c\n" + "1" * 64 + "\n",  # no timestamp
        "c\n" + "1" * 64 + "\nnan\n",
        "garbage",
    ],
)
def test_metadata_that_is_not_a_sha256_is_ignored(tmp_path: Path, lines: str) -> None:
    model = make_tiny_model(tmp_path / "model", files=1)
    name = _weights(model)[0]
    metadata = model / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text(lines.format(now=(model / name).stat().st_mtime + 1))
    assert local_dir_sha256(model, name) is None
    hashes = dict(_source_hashes(tmp_path / "out", Options(tp=1, pp=1), model))
    assert hashes[name] == hashlib.sha256((model / name).read_bytes()).hexdigest()


def test_source_files_read_together_keep_few_open(tmp_path: Path) -> None:
    """Read together, a checkpoint's files are opened as needed, a bounded number at once
    (one may have hundreds), and each descriptor reads its own file."""
    from shardprep.convert.scatter import SourceFiles

    for name in "abcde":
        (tmp_path / name).write_bytes(name.encode() * 8)
    with SourceFiles(tmp_path, most=2) as sources:
        seen = []
        for name in "abcaeda":
            assert os.pread(sources.fd(name), 8, 0) == name.encode() * 8
            seen.append(len(sources.open))
        assert max(seen) == 2
        held = list(sources.open.values())
    for fd in held:
        with pytest.raises(OSError):
            os.fstat(fd)
