"""The Hugging Face names most checkpoints share."""

from __future__ import annotations

import re

# A decoder layer's tensor: its index and its suffix inside the layer.
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"
