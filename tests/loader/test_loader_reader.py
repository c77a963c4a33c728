"""The rank-local reader: the bytes of every rank, with fastsafetensors and with the
fallback, and every way an artifact can be broken. No vLLM here."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardprep.constants import MANIFEST_NAME
from shardprep.convert.run import Options, convert
from shardprep.errors import (
    CorruptFileError,
    ManifestError,
    MissingRankFileError,
    TopologyMismatchError,
)
from shardprep.format.manifest import Manifest, read_manifest
from shardprep.loader import cpu_read, reader
from shardprep.loader.gds import GdsChoice, GdsRequest
from shardprep.loader.reader import read_rank

TP, PP = 2, 2
RANKS = [("target", pp, tp) for pp in range(PP) for tp in range(TP)]
RANKS += [("draft", PP - 1, tp) for tp in range(TP)]


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tp2 x pp2 with an EAGLE3 draft, in parts of at most 64 KiB (several per rank)."""
    model = tiny.model("reader-llama")
    draft = tiny.draft("reader-eagle3", model)
    out = tmp_path_factory.mktemp("reader") / "out"
    options = Options(tp=TP, pp=PP, draft=str(draft), max_part_bytes=64 * 1024)
    convert(str(model), out, options, progress=False)
    return out


@pytest.fixture(autouse=True)
def fresh_backend_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process would: nothing announced, nothing failed."""
    monkeypatch.setattr(reader, "_state", reader._State())


def expected_tensors(root: Path, manifest: Manifest, role: str, pp: int, tp: int) -> dict:
    tensors: dict[str, torch.Tensor] = {}
    for entry in manifest.rank_files(role, pp, tp):
        tensors.update(load_file(root / entry.path))
    return tensors


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def copy_of(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "copy"))


@pytest.mark.parametrize("backend", ["fastsafetensors", "safetensors", "auto"])
def test_every_rank_reads_the_bytes_of_its_files(artifact: Path, backend: str) -> None:
    manifest = read_manifest(artifact)
    assert len(manifest.rank_files("target", 1, 0)) > 1, "the fixture should give several parts"
    for role, pp, tp in RANKS:
        got = dict(read_rank(artifact, role, pp, tp, backend=backend, verify=True))
        assert_same_bytes(got, expected_tensors(artifact, manifest, role, pp, tp))


def test_on_the_cpu_tensors_are_read_straight_into_their_destinations(artifact: Path) -> None:
    """`into` names where each tensor goes: those are filled and yielded themselves; a
    name it declines (None) still arrives, in a tensor of its own."""
    manifest = read_manifest(artifact)
    for role, pp, tp in RANKS:
        want = expected_tensors(artifact, manifest, role, pp, tp)
        declined = sorted(want)[0]
        places = {n: torch.full_like(t, 7) for n, t in want.items() if n != declined}

        def into(name: str, info, places=places, want=want) -> torch.Tensor | None:
            assert tuple(want[name].shape) == info.shape
            return places.get(name)

        got = dict(read_rank(artifact, role, pp, tp, into=into))
        assert_same_bytes(got, want)
        assert all(got[name] is place for name, place in places.items())
        assert declined not in places and got[declined].shape == want[declined].shape


def test_bfloat16_reads_exactly(tiny, tmp_path: Path) -> None:
    model = tiny.model("reader-llama-bf16", torch_dtype="bfloat16")
    convert(str(model), tmp_path / "out", Options(tp=2, pp=1), progress=False)
    manifest = read_manifest(tmp_path / "out")
    got = dict(read_rank(tmp_path / "out", "target", 0, 1))
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert_same_bytes(got, expected_tensors(tmp_path / "out", manifest, "target", 0, 1))


def test_one_part_is_staged_at_a_time(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_open = reader._open_fast

    def recording_open(path: Path, device: str, gds: GdsRequest | None) -> reader._FastFile:
        opened = real_open(path, device, gds)
        events.append(f"open {path.name}")
        real_close = opened.buffer.close
        opened.buffer.close = lambda: (events.append(f"close {path.name}"), real_close())
        return opened

    monkeypatch.setattr(reader, "_open_fast", recording_open)
    for _ in read_rank(artifact, "target", 1, 1):
        pass
    names = [f.path.rsplit("/", 1)[-1] for f in read_manifest(artifact).rank_files("target", 1, 1)]
    assert events == [e for name in names for e in (f"open {name}", f"close {name}")]


def test_falls_back_when_fastsafetensors_is_missing(
    artifact: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "fastsafetensors", None)  # import raises ImportError
    manifest = read_manifest(artifact)
    with caplog.at_level(logging.INFO, logger="shardprep.loader"):
        for role, pp, tp in RANKS:
            got = dict(read_rank(artifact, role, pp, tp))
            assert_same_bytes(got, expected_tensors(artifact, manifest, role, pp, tp))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "safetensors safe_open" in lines[0]
    assert "fastsafetensors is not importable" in lines[0]
    assert reader.backend_in_use() == "safetensors"


def test_falls_back_once_when_fastsafetensors_fails_on_the_file_system(
    artifact: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import fastsafetensors

    calls = []

    def refuse(self: object, *args: object, **kwargs: object) -> None:
        calls.append(1)
        raise OSError(22, "O_DIRECT is not supported here")

    monkeypatch.setattr(fastsafetensors.SafeTensorsFileLoader, "copy_files_to_device", refuse)
    manifest = read_manifest(artifact)
    with caplog.at_level(logging.INFO, logger="shardprep.loader"):
        for role, pp, tp in RANKS:
            got = dict(read_rank(artifact, role, pp, tp))
            assert_same_bytes(got, expected_tensors(artifact, manifest, role, pp, tp))
    assert len(calls) == 1, "after one failure the process stays on the fallback"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "O_DIRECT is not supported here" in lines[0]
    with pytest.raises(OSError, match="O_DIRECT"):
        list(read_rank(artifact, "target", 0, 0, backend="fastsafetensors"))


def test_reads_on_without_gds_where_gds_fails(
    artifact: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GDS cannot run here: GDS is chosen, and its failure at construction (as where
    `cuFileDriverOpen` fails) stands in for it. The file is read again without GDS, and
    so is every later one, without trying GDS again."""
    import fastsafetensors

    tried: list[bool] = []
    real_init = fastsafetensors.SafeTensorsFileLoader.__init__

    def init(self: object, *args: object, nogds: bool = False, **kwargs: object) -> None:
        tried.append(nogds)
        if not nogds:
            raise RuntimeError("cuFileDriverOpen failed (gds)")
        real_init(self, *args, nogds=nogds, **kwargs)

    monkeypatch.setattr(fastsafetensors.SafeTensorsFileLoader, "__init__", init)
    monkeypatch.setattr(GdsRequest, "decide", lambda self, device: GdsChoice(True, "GDS"))
    manifest = read_manifest(artifact)
    with caplog.at_level(logging.INFO, logger="shardprep.loader"):
        for role, pp, tp in RANKS:
            got = dict(read_rank(artifact, role, pp, tp))
            assert_same_bytes(got, expected_tensors(artifact, manifest, role, pp, tp))
    assert tried[0] is False and all(tried[1:]) and len(tried) > 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cuFileDriverOpen failed (gds)" in warnings[0]
    assert reader.backend_in_use() == "fastsafetensors"


def test_logs_the_fastsafetensors_path_once(
    artifact: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="shardprep.loader"):
        for role, pp, tp in RANKS:
            list(read_rank(artifact, role, pp, tp))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "shardprep reads rank files with fastsafetensors (no GDS: device cpu, "
        "GDS needs a CUDA device)"
    ]


def test_corrupt_header_is_caught(artifact: Path, tmp_path: Path) -> None:
    root = copy_of(artifact, tmp_path)
    path = root / read_manifest(root).rank_files("target", 0, 1)[0].path
    data = bytearray(path.read_bytes())
    data[8] = ord("[")  # the JSON object now opens as a list: same size, broken header
    path.write_bytes(bytes(data))
    for backend in ("fastsafetensors", "safetensors"):
        with pytest.raises(CorruptFileError, match="not a valid safetensors file") as info:
            list(read_rank(root, "target", 0, 1, backend=backend))
        assert info.value.path == str(path)


def test_verify_catches_a_flipped_byte(artifact: Path, tmp_path: Path) -> None:
    root = copy_of(artifact, tmp_path)
    path = root / read_manifest(root).rank_files("draft", 1, 0)[-1].path
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert dict(read_rank(root, "draft", 1, 0)), "without verify the bytes are not hashed"
    with pytest.raises(CorruptFileError) as info:
        list(read_rank(root, "draft", 1, 0, verify=True))
    assert str(info.value).startswith(f"{path} does not match the sha256 that {MANIFEST_NAME}")
    assert "re-run `shardprep convert`" in str(info.value)


def test_a_truncated_file_is_caught_without_verify(artifact: Path, tmp_path: Path) -> None:
    root = copy_of(artifact, tmp_path)
    path = root / read_manifest(root).rank_files("target", 1, 0)[0].path
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CorruptFileError, match="truncated or was replaced"):
        list(read_rank(root, "target", 1, 0))


def test_missing_rank_file_says_what_to_do(artifact: Path, tmp_path: Path) -> None:
    root = copy_of(artifact, tmp_path)
    entry = read_manifest(root).rank_files("target", 1, 1)[1]
    (root / entry.path).unlink()
    with pytest.raises(MissingRankFileError) as info:
        list(read_rank(root, "target", 1, 1))
    assert isinstance(info.value, FileNotFoundError)
    assert str(info.value) == (
        f"{root} lacks 1 file(s) of target rank pp1 tp1 that {MANIFEST_NAME} lists "
        f"({entry.path}); re-run `shardprep convert` into {root} (it resumes), "
        "or fetch stage 1 again"
    )


def test_headers_must_match_the_manifest(artifact: Path, tmp_path: Path) -> None:
    root = copy_of(artifact, tmp_path)
    data = json.loads((root / MANIFEST_NAME).read_text())
    target = next(m for m in data["models"] if m["role"] == "target")
    target["ranks"]["pp0-tp0"]["model.layers.0.input_layernorm.weight"]["shape"] = [3]
    (root / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(CorruptFileError, match=r"1 tensor\(s\) differ"):
        list(read_rank(root, "target", 0, 0))


def test_a_stage_that_was_not_converted(tiny, tmp_path: Path) -> None:
    model = tiny.model("reader-llama")
    convert(str(model), tmp_path / "out", Options(tp=1, pp=2, stage=1), progress=False)
    assert dict(read_rank(tmp_path / "out", "target", 1, 0))
    with pytest.raises(TopologyMismatchError) as info:
        list(read_rank(tmp_path / "out", "target", 0, 0))
    assert str(info.value) == (
        f"{tmp_path / 'out'} holds only stage(s) 1, not stage 0; for this node, convert that "
        f"stage (`shardprep convert {model} --tp 1 --pp 2 --stage 0 -o OUT`) or fetch it "
        "(`shardprep fetch REPO --stage 0`)"
    )


def test_no_manifest_suggests_convert(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="shardprep convert"):
        list(read_rank(tmp_path, "target", 0, 0))


def test_unknown_backend(artifact: Path) -> None:
    with pytest.raises(ValueError, match="auto, fastsafetensors, safetensors"):
        list(read_rank(artifact, "target", 0, 0, backend="mmap"))


@pytest.mark.parametrize(
    ("chunk", "direct", "cached"),
    [
        (4096, True, False),  # chunks far smaller than most tensors, cold: O_DIRECT only
        (8192, True, True),  # chunks from the page cache, the rest with O_DIRECT
        (8192, False, True),  # no O_DIRECT on this file system: plain reads
        (1 << 30, True, True),  # one chunk past the end of every file
    ],
    ids=["4k-direct", "8k-cached-then-direct", "8k-plain", "1g"],
)
def test_chunked_reads_of_any_size_read_the_same_bytes(
    artifact: Path, chunk: int, direct: bool, cached: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file is read ahead in chunks, from the page cache where it holds them and
    with O_DIRECT where not (or plain reads, where O_DIRECT is refused); whatever the
    chunk size, every tensor read straight into its place is exact."""
    monkeypatch.setattr(cpu_read, "CHUNK_BYTES", chunk)
    if not direct:
        monkeypatch.setattr(cpu_read, "_open_direct", lambda path: None)
    if not cached:
        monkeypatch.setattr(cpu_read, "_resident_prefix", lambda residency, offset, length: 0)
    else:  # the page cache holds the files: still through the chunks, not whole-file reads
        monkeypatch.setattr(cpu_read, "_starts_cached", lambda path, fd, offset: False)
    manifest = read_manifest(artifact)
    for role, pp, tp in RANKS:
        want = expected_tensors(artifact, manifest, role, pp, tp)
        places = {n: torch.full_like(t, 7) for n, t in want.items()}
        got = dict(read_rank(artifact, role, pp, tp, into=lambda n, _, p=places: p[n]))
        assert_same_bytes(got, want)
        assert all(got[name] is place for name, place in places.items())


def test_o_direct_refused_at_read_time_falls_back_to_plain_reads(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system may accept O_DIRECT at open and refuse the read (EINVAL): the rest
    of the file is read with plain reads."""
    import errno
    import os

    real_preadv = os.preadv
    direct_fds: list[int | None] = []
    real_open_direct = cpu_read._open_direct

    def open_direct(path: Path) -> int | None:
        fd = real_open_direct(path)
        direct_fds.append(fd)
        return fd

    def preadv(fd: int, buffers: list, offset: int, *flags: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(cpu_read, "_open_direct", open_direct)
    monkeypatch.setattr(cpu_read, "_resident_prefix", lambda residency, offset, length: 0)
    monkeypatch.setattr(cpu_read.os, "preadv", preadv)
    manifest = read_manifest(artifact)
    want = expected_tensors(artifact, manifest, "target", 0, 0)
    places = {n: torch.full_like(t, 7) for n, t in want.items()}
    got = dict(read_rank(artifact, "target", 0, 0, into=lambda n, _: places[n]))
    assert_same_bytes(got, want)
    assert any(fd is not None for fd in direct_fds)


def test_a_reader_left_early_stops_its_thread(artifact: Path) -> None:
    """Closing the tensor iterator half way stops the thread that reads ahead."""
    import threading

    before = {t for t in threading.enumerate() if t.name.startswith(cpu_read.READ_THREAD)}
    manifest = read_manifest(artifact)
    want = expected_tensors(artifact, manifest, "target", 1, 1)
    places = {n: torch.empty_like(t) for n, t in want.items()}
    tensors = read_rank(artifact, "target", 1, 1, into=lambda n, _: places[n])
    next(tensors)
    tensors.close()
    after = {t for t in threading.enumerate() if t.name.startswith(cpu_read.READ_THREAD)}
    assert after <= before
