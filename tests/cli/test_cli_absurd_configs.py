"""Absurd or hostile values in config.json end as one line and exit 1 within a memory
limit and a few seconds: a count far beyond what the checkpoint's headers hold is
compared with them before anything is enumerated, and a value vLLM cannot use (a zero it
divides by, a fractional count, a block size of zeros, strings or floats, an ignore
pattern that is not a regular expression) is named."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hub_server import HubServer
from huggingface_hub import HfApi

from shardprep.demo.tiny import TINY_FP8, TINY_FP8_CT, TINY_INT4, make_tiny_model

MEMORY_LIMIT = 512 * 1024**2  # `plan` of a tiny model needs about a tenth of it
SECONDS = 5.0  # per case, imports excluded
BILLION = 10**9
COUNT = "which needs more tensors than the"

# (id, architecture, quantization_config, key path in config.json, value, the line's words)
CASES: list[tuple[str, str, dict | None, str, Any, str]] = [
    ("qwen3-moe-experts", "Qwen3MoeForCausalLM", None, "num_experts", BILLION,
     f"num_experts=1000000000, {COUNT}"),
    ("mixtral-experts", "MixtralForCausalLM", None, "num_local_experts", BILLION,
     f"num_local_experts=1000000000, {COUNT}"),
    ("deepseek-experts", "DeepseekV3ForCausalLM", None, "n_routed_experts", BILLION,
     f"n_routed_experts=1000000000, {COUNT}"),
    ("deepseek-mtp", "DeepseekV3ForCausalLM", None, "num_nextn_predict_layers", BILLION,
     f"num_nextn_predict_layers=1000000000, {COUNT}"),
    ("deepseek-v4-experts", "DeepseekV4ForCausalLM", None, "n_routed_experts", BILLION,
     f"n_routed_experts=1000000000, {COUNT}"),
    ("glm-mtp", "Glm4MoeForCausalLM", None, "num_nextn_predict_layers", BILLION,
     f"num_nextn_predict_layers=1000000000, {COUNT}"),
    ("qwen3-next-mtp", "Qwen3NextForCausalLM", None, "num_nextn_predict_layers", BILLION,
     f"num_nextn_predict_layers=1000000000, {COUNT}"),
    ("kimi-k3-mtp", "KimiK3ForConditionalGeneration", None,
     "text_config.num_nextn_predict_layers", BILLION,
     f"num_nextn_predict_layers=1000000000, {COUNT}"),
    ("qwen3.5-moe-vision", "Qwen3_5MoeForConditionalGeneration", None, "vision_config.depth",
     BILLION, f"vision_config.depth=1000000000, {COUNT}"),
    ("kimi-k3-vision", "KimiK3ForConditionalGeneration", None,
     "vision_config.vt_num_hidden_layers", BILLION,
     f"vision_config.vt_num_hidden_layers=1000000000, {COUNT}"),
    # Experts stacked in one tensor per layer: compared with the stack's first dimension.
    ("gpt-oss-experts", "GptOssForCausalLM", None, "num_local_experts", BILLION,
     "num_local_experts=1000000000, but the checkpoint's stacked tensors "
     "(model.layers.0.mlp.experts.gate_up_proj_bias ...) hold at most 4"),
    ("qwen3.5-moe-experts", "Qwen3_5MoeForConditionalGeneration", None,
     "text_config.num_experts", BILLION,
     "num_experts=1000000000, but the checkpoint's stacked tensors"),
    # Values vLLM divides by, or cannot count with.
    ("moe-layer-freq-0", "DeepseekV3ForCausalLM", None, "moe_layer_freq", 0,
     "config.json has moe_layer_freq: 0, which is not a whole number of at least 1"),
    ("sparse-step-0", "Qwen3MoeForCausalLM", None, "decoder_sparse_step", 0,
     "config.json has decoder_sparse_step: 0, which is not a whole number of at least 1"),
    ("experts-8.5", "Qwen3MoeForCausalLM", None, "num_experts", 8.5,
     "config.json has num_experts: 8.5, which is not a whole number"),
    ("mtp-text", "Qwen3NextForCausalLM", None, "num_nextn_predict_layers", "abc",
     "config.json has num_nextn_predict_layers: 'abc', which is not a whole number"),
    ("block-zero", "LlamaForCausalLM", TINY_FP8, "quantization_config.weight_block_size",
     [0, 128], "weight_block_size [0, 128], which is not two whole numbers of at least 1"),
    ("block-strings", "LlamaForCausalLM", TINY_FP8, "quantization_config.weight_block_size",
     ["128", "128"], "weight_block_size ['128', '128'], which is not two whole numbers"),
    ("block-floats", "LlamaForCausalLM", TINY_FP8, "quantization_config.weight_block_size",
     [128.0, 128.0], "weight_block_size [128.0, 128.0], which is not two whole numbers"),
    ("ct-block-zero", "LlamaForCausalLM", TINY_FP8_CT,
     "quantization_config.config_groups.group_0.weights",
     {"strategy": "block", "block_structure": [0, 128]},
     "weights block_structure [0, 128]"),
    ("ct-bad-regex", "LlamaForCausalLM", TINY_FP8_CT, "quantization_config.ignore", ["re:("],
     "an ignore pattern 're:(' that is not a regular expression"),
    ("int4-bad-regex", "DeepseekV3ForCausalLM", TINY_INT4, "quantization_config.ignore",
     ["re:("], "an ignore pattern 're:(' that is not a regular expression"),
]  # fmt: skip

# The child: every case's `shardprep plan` in one process under the memory limit.
CHILD = """
import contextlib, io, json, resource, sys, time
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from shardprep.cli import main
found = {}
for name, model in json.loads(sys.argv[2]).items():
    err, start = io.StringIO(), time.monotonic()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["plan", model])
    except BaseException as exc:
        code, err = -1, io.StringIO(f"{type(exc).__name__}: {exc}")
    found[name] = [code, err.getvalue(), time.monotonic() - start]
print(json.dumps(found))
"""


def plan_within_limits(models: dict[str, str], env: dict[str, str] | None = None) -> dict:
    """{name: [exit status, stderr, seconds]} of `shardprep plan MODEL` for each of
    `models` (a folder or a Hub repo id), all in one child process under MEMORY_LIMIT."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(MEMORY_LIMIT), json.dumps(models)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout)


def _set(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, key = path.split(".")
    for part in parents:
        config = config[part]
    if isinstance(value, dict):  # keys set beside the others
        config[key] |= value
    else:
        config[key] = value


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    root = tmp_path_factory.mktemp("absurd")
    bases: dict[tuple[str, str], Path] = {}
    folders = {}
    for name, architecture, quant, path, value, _ in CASES:
        base = (architecture, json.dumps(quant))
        if base not in bases:
            extra = {"quantization_config": copy.deepcopy(quant)} if quant else {}
            folder = root / f"base-{len(bases)}"
            bases[base] = make_tiny_model(folder, architecture, num_hidden_layers=2, **extra)
        folder = root / name
        shutil.copytree(bases[base], folder)
        config = json.loads((folder / "config.json").read_text())
        _set(config, path, copy.deepcopy(value))
        (folder / "config.json").write_text(json.dumps(config))
        folders[name] = str(folder)
    return plan_within_limits(folders)


@pytest.mark.parametrize(
    ("name", "words"), [(case[0], case[-1]) for case in CASES], ids=[case[0] for case in CASES]
)
def test_an_absurd_config_is_one_line_within_bounds(results, name: str, words: str) -> None:
    code, err, seconds = results[name]
    assert code == 1, err
    assert err.startswith("shardprep: error: ") and err.count("\n") == 1, err
    assert words in err
    assert seconds < SECONDS, f"{name} took {seconds:.1f}s"


@pytest.mark.usefixtures("hf_client_env")
@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # the client's PUT
def test_an_absurd_count_of_a_hub_repo_is_one_line_from_its_metadata(
    hub: HubServer, tmp_path: Path
) -> None:
    """`plan ORG/MODEL` reads only config.json and the headers: the same line, in bounds."""
    model = make_tiny_model(tmp_path / "model", "DeepseekV3ForCausalLM", num_hidden_layers=2)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": BILLION}))
    api = HfApi(endpoint=hub.endpoint)
    api.create_repo("org/absurd")
    api.upload_folder(repo_id="org/absurd", folder_path=model)
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "home")}
    code, err, seconds = plan_within_limits({"hub": "org/absurd"}, env)["hub"]
    assert code == 1 and err.count("\n") == 1, err
    assert f"num_nextn_predict_layers=1000000000, {COUNT}" in err
    assert seconds < SECONDS
