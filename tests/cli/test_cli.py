"""The command line: one clear line and exit 1 for user mistakes, data on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardprep.cli import main
from shardprep.cli.sizes import parse_size


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardprep.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_convert_inspect_verify_through_the_console(tiny, tmp_path: Path) -> None:
    model = tiny.model("llama")
    draft = tiny.draft("eagle3", model)
    out = tmp_path / "out"
    result = run(
        "convert",
        "--tp",
        "2",
        "--pp",
        "2",
        str(model),
        "-o",
        str(out),
        "--draft",
        str(draft),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert "    1  draft     1      1       11" in result.stdout
    inspected = json.loads(run("inspect", str(out), "--json").stdout)
    assert inspected["topology"] == {"tp": 2, "pp": 2, "partition": [2, 2]}
    assert (inspected["serves"], inspected["served_tps"]) == ("tp 1, 2 x any pp", [1, 2])
    assert "serves: tp 1, 2 x any pp" in run("inspect", str(out)).stdout
    assert [r["role"] for r in inspected["ranks"]] == ["target"] * 4 + ["draft"] * 2
    verified = run("verify", str(out), "--full", "--json", "--quiet")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["round_trip_tensors"] > 0


def test_plan_json_writes_nothing(tiny, tmp_path: Path, capsys) -> None:
    model = tiny.model("llama")
    assert main(["plan", "--tp", "2", "--pp", "2", str(model), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["ranks"]) == 4
    assert summary["files"][0]["tensors"][0]["name"] == "model.layers.0.self_attn.qkv_proj.weight"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3"], "num_attention_heads (4) is not divisible by tp=3"),
        (["--pp", "2", "--pp-partition", "1,1"], "sums to 2 but the model has 4 layers"),
        (["--max-part-size", "5 parsecs"], "size '5 parsecs' is not understood"),
        (["--stage", "3", "--pp", "2"], "--stage 3 is outside the pipeline stages 0..1"),
        (["--tp", "0"], "--tp 0: the tensor parallel size is at least 1"),
        (["--max-part-size", "1.2.3"], "--max-part-size: size '1.2.3' is not understood"),
        (["--max-part-size", "0"], "--max-part-size: size '0' is not a size a file can have"),
        (["--max-part-size", "0.1"], "size '0.1' is not a size a file can have"),
        (["--max-part-size", "9" * 400], "is not a size a file can have"),
        (["--pp-partition", ""], "--pp-partition is empty; give the layers per stage"),
        (["--draft-method", "eagle3"], "--draft-method eagle3 needs --draft DRAFT"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "convert"])
def test_user_mistakes_are_one_line_and_exit_1(
    tiny, tmp_path: Path, args, message, command, capsys
) -> None:
    out = tmp_path / "out"
    extra = ["-o", str(out)] if command == "convert" else []
    assert main([command, str(tiny.model("llama")), *args, *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardprep: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_verify_of_a_folder_without_manifest(tmp_path: Path, capsys) -> None:
    assert main(["verify", str(tmp_path)]) == 1
    assert "has no shardprep.json" in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardprep.cli", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        env={"SHARDPREP_DEBUG": "1", "PATH": ""},
    )
    assert result.returncode == 1 and "Traceback" in result.stderr


@pytest.mark.parametrize("value", ["0", "false", "no", "off", "OFF", ""])
def test_debug_off_in_words_shows_no_traceback(tmp_path: Path, value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardprep.cli", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        # PYTHONPATH kept: the package under test, not one installed elsewhere
        env={"SHARDPREP_DEBUG": value, "PATH": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_demo_runs_offline() -> None:
    result = run("demo")
    assert result.returncode == 0, result.stderr
    assert "source tensors rebuilt byte for byte" in result.stdout


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GiB", 5 * 2**30),
        ("500MB", 500 * 10**6),
        ("123", 123),
        ("1.5GiB", 3 * 2**29),
        (".5KiB", 512),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size
