"""A local folder converts without importing the Hub client (a third of a second of
start-up here, paid by every `shardprep convert` of a folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conftest import TinyModels

CHILD = """
import json, sys
from shardprep.cli import main
status = main(["convert", "--quiet", *sys.argv[1:]])
print(json.dumps({"status": status, "hub": sorted(m for m in sys.modules
                  if m.split(".")[0] == "huggingface_hub" and m != "huggingface_hub")}))
"""


def test_converting_a_folder_leaves_huggingface_hub_unimported(
    tiny: TinyModels, tmp_path: Path
) -> None:
    model = tiny.model("llama")
    out = tmp_path / "out"
    args = [str(model), "-o", str(out), "--tp", "2", "--pp", "2"]
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"status": 0, "hub": []}
    assert (out / "shardprep.json").is_file()
