#!/usr/bin/env bash
# Set up relayrl in ./.venv (idempotent). torch is installed first, pinned to the CPU
# build, so that no other package can pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.relayrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[dev,bench]"  # bench: trl for tests/test_bench.py (it pulls no other torch)
  touch "$stamp"
fi
