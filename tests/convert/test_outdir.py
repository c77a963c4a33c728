"""The output folder: one convert at a time, I/O failures as one line, nothing left behind."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardprep.cli import main
from shardprep.constants import INCOMPLETE_SUFFIX, LOCK_NAME, MANIFEST_NAME, PARTIAL_MARKER
from shardprep.convert import outdir
from shardprep.demo.tiny import make_tiny_model
from shardprep.errors import OutputLockedError

CLI = [sys.executable, "-m", "shardprep.cli"]


def run(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,  # type: ignore[call-overload]
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.startswith("shardprep: error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    return result.stderr


def leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob(f"*{INCOMPLETE_SUFFIX}"))


def test_a_second_convert_into_a_busy_folder_names_the_holder_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Two real converts into one folder: the second stops at once, naming the first
    (pid and host); the first finishes with an artifact that verifies."""
    # Big enough (60 MB) that the first convert holds the lock for a visible while.
    model = make_tiny_model(tmp_path / "model", vocab_size=60_000)
    out = tmp_path / "out"
    args = ["convert", str(model), "-o", str(out), "--tp", "2", "--quiet"]
    first = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _holder(out) != first.pid:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first convert never took the lock"
            time.sleep(0.001)
        os.kill(first.pid, signal.SIGSTOP)  # hold it there, mid-convert
        before = sorted(p.name for p in out.rglob("*"))
        second = run(*args)
        err = one_line_error(second)
        assert f"pid {first.pid} on {socket.gethostname()}" in err
        assert "is being written by another shardprep convert" in err
        assert sorted(p.name for p in out.rglob("*")) == before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert run("verify", str(out), "--quiet").returncode == 0
    assert not (out / LOCK_NAME).exists() and not leftovers(out)
    again = run(*args)
    assert again.returncode == 0, again.stderr
    assert "already complete: all 2 rank files verified" in again.stdout
    shutil.rmtree(tmp_path)  # 60 MB of model, 30 of artifact: not kept among pytest's runs


def _holder(out: Path) -> int | None:
    try:
        return int(json.loads((out / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def test_the_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    with outdir.locked(tmp_path):
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder == {"pid": os.getpid(), "host": socket.gethostname()}
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"), outdir.locked(tmp_path):
            pass
    assert not (tmp_path / LOCK_NAME).exists()
    with outdir.locked(tmp_path):
        pass


def _file_size_limit(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_write_failure_is_one_line_leaves_no_temporary_file_and_resumes(
    tiny, tmp_path: Path
) -> None:
    """A file-size limit makes every write past 64 KiB fail as a full disk would."""
    model = tiny.model("llama")
    out = tmp_path / "out"
    args = ["convert", str(model), "-o", str(out), "--tp", "2", "--quiet"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    failed = run(*args, preexec_fn=lambda: _file_size_limit(64 * 1024), env=env)
    err = one_line_error(failed)
    assert f"convert to {out} failed: File too large" in err and "rerun the same command" in err
    assert not leftovers(out) and not (out / MANIFEST_NAME).exists()
    assert not (out / LOCK_NAME).exists()
    resumed = run(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert run("verify", str(out), "--quiet").returncode == 0


def in_process_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and err.count("\n") == 1
    return err


def test_output_naming_a_file(tiny, tmp_path: Path, capsys) -> None:
    target = tmp_path / "taken"
    target.write_text("not a folder")
    err = in_process_error(capsys, "convert", str(tiny.model("llama")), "-o", str(target))
    assert f"{target} is a file, not a folder" in err
    assert target.read_text() == "not a folder" and sorted(tmp_path.iterdir()) == [target]


def test_a_damaged_journal_says_how_to_start_over(tiny, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / PARTIAL_MARKER).write_text('{"plan": "x", "done": ')
    err = in_process_error(capsys, "convert", str(tiny.model("llama")), "-o", str(out))
    assert "the record of an interrupted convert, is damaged" in err
    assert f"delete the folder {out} and run the same convert again" in err
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL_MARKER]


def test_a_folder_of_someone_else_is_left_as_it_was(tiny, tmp_path: Path, capsys) -> None:
    out = tmp_path / "downloads"
    out.mkdir()
    (out / "film.mkv.incomplete").write_text("half a film")
    err = in_process_error(capsys, "convert", str(tiny.model("llama")), "-o", str(out))
    assert "already holds files that are not a shardprep artifact" in err
    assert sorted(p.name for p in out.iterdir()) == ["film.mkv.incomplete"]


# A file outside the output folder that links planted inside it point to.
VICTIM_TEXT = "a file of the user's, outside the artifact\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    return victim


def _links(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_symlink())


def test_a_lock_name_linked_outside_is_refused_and_the_target_untouched(
    tiny, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    err = one_line_error(run("convert", str(tiny.model("llama")), "-o", str(out), "--quiet"))
    assert f"{out / LOCK_NAME} is a symbolic link, not shardprep's lock" in err
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_links_planted_in_an_artifact_are_replaced_never_written_through(
    tiny, tmp_path: Path
) -> None:
    """Every name a rerun writes (rank files and their temporary names, copied files, the
    journal's and the manifest's temporary names) planted as a link to a file outside:
    the rerun repairs the artifact, which then holds no link, and the file is unchanged."""
    victim = _victim(tmp_path)
    model = tiny.model("llama")
    out = tmp_path / "out"
    args = ["convert", str(model), "-o", str(out), "--tp", "2", "--quiet"]
    assert run(*args).returncode == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    rank_file = out / manifest["files"][0]["path"]
    planted = [
        rank_file,
        rank_file.with_name(rank_file.name + INCOMPLETE_SUFFIX),
        out / manifest["files"][1]["path"],
        out / "config.json",
        out / ("config.json" + INCOMPLETE_SUFFIX),
        out / (PARTIAL_MARKER + INCOMPLETE_SUFFIX),
    ]
    for path in planted:
        path.unlink(missing_ok=True)
        path.symlink_to(victim)
    done = run(*args)
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == VICTIM_TEXT
    assert _links(out) == [] and not leftovers(out)
    assert (out / "config.json").read_bytes() == (model / "config.json").read_bytes()
    verified = run("verify", str(out), "--quiet")
    assert verified.returncode == 0, verified.stderr


def test_a_rank_folder_linked_outside_is_refused(tiny, tmp_path: Path) -> None:
    elsewhere = _victim(tmp_path).parent
    model = tiny.model("llama")
    out = tmp_path / "out"
    args = ["convert", str(model), "-o", str(out), "--quiet"]
    assert run(*args).returncode == 0
    shutil.rmtree(out / "shards")
    (out / "shards").symlink_to(elsewhere, target_is_directory=True)
    err = one_line_error(run(*args))
    assert f"{out / 'shards'} is a symbolic link; shardprep writes only inside {out}" in err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["victim.txt"]
    assert (elsewhere / "victim.txt").read_text() == VICTIM_TEXT


def _stop_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> None:
    """Freeze `proc` at a moment where `ready()` holds (checked while it is stopped)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the convert never reached the state looked for"
        os.kill(proc.pid, signal.SIGSTOP)
        if ready():
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.002)


def _mid_write(out: Path) -> bool:
    """Some rank files renamed into place, others still under their temporary names."""
    shards = out / "shards"
    names = [p.name for p in shards.iterdir()] if shards.is_dir() else []
    done = [n for n in names if n.endswith(".safetensors")]
    return bool(done) and len(done) < len(names)


def _rank_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in (out / "shards").iterdir())


def test_a_rerun_with_another_plan_after_a_kill_leaves_only_its_own_files(
    tmp_path: Path,
) -> None:
    """A convert killed (SIGKILL) mid-write at one --max-part-size, rerun at another:
    the killed run's temporary files and its rank files the new plan does not name are
    gone; what is under shards/ is exactly what the new manifest lists."""
    model = make_tiny_model(tmp_path / "model", vocab_size=60_000)
    out = tmp_path / "out"
    first = subprocess.Popen(
        [*CLI, "convert", str(model), "-o", str(out), "--tp", "2", "--max-part-size", "1MiB"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _stop_when(first, lambda: _mid_write(out))
        before = _rank_files(out)
    finally:
        first.kill()
        first.wait()
    assert leftovers(out) and any(n.endswith(".safetensors") for n in before)
    again = run("convert", str(model), "-o", str(out), "--tp", "2", "--max-part-size", "3MiB")
    assert again.returncode == 0, again.stderr
    listed = sorted(f["path"] for f in json.loads((out / MANIFEST_NAME).read_text())["files"])
    assert _rank_files(out) == listed and not leftovers(out)
    assert set(before) - set(listed), "the two plans should name different files"
    assert run("verify", str(out), "--quiet").returncode == 0
    shutil.rmtree(tmp_path)


def test_sigterm_stops_cleanly_and_the_rerun_resumes(tmp_path: Path) -> None:
    """SIGTERM mid-write is handled as Ctrl-C is: one line, no temporary file left, the
    journal kept; the same command then resumes, keeping the files already complete."""
    model = make_tiny_model(tmp_path / "model", vocab_size=60_000)
    out = tmp_path / "out"
    args = ["convert", str(model), "-o", str(out), "--tp", "2", "--max-part-size", "1MiB"]
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _stop_when(proc, lambda: _mid_write(out))
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "shardprep: terminated; rerun the same command to resume"
    assert "Traceback" not in err
    assert not leftovers(out) and (out / PARTIAL_MARKER).is_file()
    assert not (out / MANIFEST_NAME).exists() and not (out / LOCK_NAME).exists()
    resumed = run(*args, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "found complete and verified" in resumed.stdout
    assert run("verify", str(out), "--quiet").returncode == 0
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_of_an_artifact_takes_the_umask_mode(tiny, tmp_path: Path, umask: int) -> None:
    """The manifest as the rank files and the copied files: 0666 less the umask (mkstemp
    alone would make it 0600)."""
    out = tmp_path / "out"
    result = run(
        "convert", str(tiny.model("llama")), "-o", str(out), "--tp", "2", "--quiet",
        preexec_fn=lambda: os.umask(umask),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    modes = {
        str(p.relative_to(out)): oct(p.stat().st_mode & 0o777)
        for p in out.rglob("*")
        if p.is_file()
    }
    assert MANIFEST_NAME in modes and len(modes) > 3
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))
