"""What a new user meets: hostile or broken inputs end as one line and exit 1, the
commands agree with one another, and logs get plain lines."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardprep.cli import main
from shardprep.demo.tiny import make_tiny_model
from shardprep.progress import Progress


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and err.count("\n") == 1, err
    return err


def broken_model(tmp_path: Path, **config: object) -> Path:
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=2)
    text = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**text, **config}))
    return model


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": "abc"}, "config.json has hidden_size: 'abc', which is not a whole number"),
        ({"num_attention_heads": 0}, "config.json has num_attention_heads: 0"),
        ({"num_hidden_layers": "2"}, "config.json has num_hidden_layers: '2'"),
        # Would plan a billion layers (forever, without bound): refused from the tensors.
        ({"num_hidden_layers": 1e9}, "num_hidden_layers=1000000000.0 but the checkpoint holds"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "convert"])
def test_a_broken_config_is_one_line(tmp_path: Path, capsys, config, message, command) -> None:
    model = broken_model(tmp_path, **config)
    out = tmp_path / "out"
    extra = ["-o", str(out)] if command == "convert" else []
    assert message in one_line_error(capsys, command, str(model), *extra)
    assert not out.exists()


@pytest.mark.parametrize("fifo", ["model.safetensors", "config.json"])
def test_a_fifo_is_refused_not_read(tiny, tmp_path: Path, capsys, fifo: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny.model("llama"), model)
    (model / fifo).unlink()
    os.mkfifo(model / fifo)  # reading it would block forever
    err = one_line_error(capsys, "plan", str(model))
    assert f"{fifo} is not a regular file" in err


def test_every_topology_problem_is_reported_at_once(tiny, capsys) -> None:
    err = one_line_error(capsys, "plan", str(tiny.model("llama")), "--tp", "3", "--pp", "6")
    assert "fewer than pp=6 stages" in err
    assert "num_attention_heads (4) is not divisible by tp=3" in err


def test_a_partition_from_the_environment_says_so(tiny, capsys, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,1")
    err = one_line_error(capsys, "plan", str(tiny.model("llama")), "--pp", "2")
    assert "layer partition '1,1' from the environment (VLLM_PP_LAYER_PARTITION) sums to 2" in err


def test_plan_and_convert_agree_and_a_rerun_says_complete(tiny, tmp_path: Path, capsys) -> None:
    model, out = str(tiny.model("llama")), str(tmp_path / "out")
    assert main(["plan", model, "--tp", "2", "--pp", "2", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["plan", model, "--tp", "2", "--pp", "2"]) == 0
    plan_table = capsys.readouterr().out.split("stage  role", 1)[1]
    assert main(["convert", model, "-o", out, "--tp", "2", "--pp", "2", "-q", "--json"]) == 0
    converted = json.loads(capsys.readouterr().out)
    assert planned["ranks"] == converted["ranks"]
    assert converted["written_files"] == 4 and converted["kept_files"] == 0
    assert main(["convert", model, "-o", out, "--tp", "2", "--pp", "2", "-q"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        f"{out} was already complete: all 4 rank files verified against their sha256"
    )
    assert text.split("stage  role", 1)[1] == plan_table


def test_progress_outside_a_terminal_is_plain_lines(tiny, tmp_path: Path, capsys) -> None:
    model, out = str(tiny.model("llama")), str(tmp_path / "out")
    assert main(["convert", model, "-o", out, "--tp", "2"]) == 0
    assert main(["verify", out]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert lines[0].startswith("convert:   0%") and lines[-1].startswith("verify: 100%")


def test_progress_on_a_terminal_is_a_bar() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with Progress(total=10, file=stream, desc="x") as bar:
        bar.update(10)
    assert "\r" in stream.getvalue() and "|" in stream.getvalue()


def test_demo_json_and_keep(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["artifact"] is None and data["verified"]["round_trip_tensors"] > 0
    assert [m["source"] for m in data["models"]] == ["model", "eagle3"]
    assert main(["demo", "--keep"]) == 0
    text = capsys.readouterr().out
    kept = Path(text.split("kept in ", 1)[1].split(" (", 1)[0])
    try:
        assert (kept / "shardprep.json").is_file() and str(kept) in text
    finally:
        shutil.rmtree(kept.parent)


def test_demo_names_no_deleted_folder(capsys) -> None:
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert "temporary folder, now deleted (--keep keeps it)" in text
    assert "shardprep-demo-" not in text


@pytest.mark.parametrize("args", [["demo", "-q"], ["inspect", "x", "--quiet"]])
def test_flags_that_would_do_nothing_are_refused(args: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_a_folder_in_place_of_a_rank_file_is_one_line_in_verify(
    tiny, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(tiny.model("llama")), "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    shard = next((out / "shards").iterdir())
    shard.unlink()
    shard.mkdir()
    err = one_line_error(capsys, "verify", str(out), "-q")
    assert str(shard.name) in err


CLI = [sys.executable, "-m", "shardprep.cli"]


def test_an_error_line_is_bounded(tiny, tmp_path: Path) -> None:
    """A manifest that names a parameter a million characters long: verify's error is one
    line of about a thousand characters that says how much was left out."""
    out = tmp_path / "out"
    assert main(["convert", str(tiny.model("llama")), "-o", str(out), "--quiet"]) == 0
    manifest = json.loads((out / "shardprep.json").read_text())
    rank = manifest["models"][0]["ranks"]["pp0-tp0"]
    rank["x" * 1_000_000] = {"dtype": "F32", "shape": [1]}
    (out / "shardprep.json").write_text(json.dumps(manifest))
    result = subprocess.run(
        [*CLI, "verify", str(out), "--quiet"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("shardprep: error: ")
    assert len(result.stderr) < 1200 and " more characters)\n" in result.stderr


def test_a_closed_pipe_ends_the_output_quietly(tiny) -> None:
    """`shardprep plan ... | head`: the reader is gone before the output is written; no
    "Broken pipe" message, no traceback, and exit status 0, as when the reader goes after
    the output is written (which of the two happens is a race)."""
    proc = subprocess.Popen(
        [*CLI, "plan", str(tiny.model("llama")), "--tp", "2", "--json", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command has printed anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert err == ""


def test_a_cache_dir_that_is_a_file_is_named(tmp_path: Path, capsys) -> None:
    taken = tmp_path / "cache"
    taken.write_text("not a folder")
    assert main(["fetch", "org/Model", "--stage", "0", "--cache-dir", str(taken)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"shardprep: error: the cache folder {taken} is a file, not a folder; point "
        "--cache-dir at a folder\n"
    )
    assert taken.read_text() == "not a folder"
