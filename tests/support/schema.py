"""The manifest's JSON Schema (docs/manifest.schema.json), which every emitted manifest
is checked against."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "docs" / "manifest.schema.json").read_text()
)
