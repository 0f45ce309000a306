#!/usr/bin/env bash
# Set up relayrl in ./.venv (idempotent) at the exact versions CI tests: pyproject.toml says what
# relayrl needs (ranges), constraints.txt pins what is installed. torch is installed first, the CPU
# build, so that no other package can pull a CUDA torch. Reinstalls when either file changes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.relayrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # --no-compile: Python compiles the modules a run imports on first use, not every file of every package
  python -m pip install -q --no-compile -c constraints.txt torch
  python -m pip install -q --no-compile -c constraints.txt -e ".[dev,bench]"  # bench: trl for tests/test_bench.py (it pulls no other torch)
  touch "$stamp"
fi
