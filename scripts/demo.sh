#!/usr/bin/env bash
# Creates .venv, installs shardprep, and runs `shardprep demo`: a tiny Llama with an
# EAGLE3 draft converted at tp2 x pp2, verified, and shown per stage and rank.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SHARDPREP_DEMO_VENV:-.venv}"
if [ ! -x "$venv/bin/shardprep" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  # A CPU build of torch keeps the install small where one is at hand.
  "$venv/bin/pip" install --quiet "torch==2.13.0" >/dev/null 2>&1 || true
  "$venv/bin/pip" install --quiet -e .
fi
exec "$venv/bin/shardprep" demo "$@"
