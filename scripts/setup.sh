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
  # uv installs (pinned in constraints.txt, bootstrapped with pip): the same packages as pip, pip's settings
  # passed on (scripts/venvs.sh), in ~18 s instead of ~38 s; nothing is byte-compiled ahead (Python compiles
  # the modules a run imports on first use)
  python -m pip install -q --disable-pip-version-check --no-compile -c constraints.txt uv 2>&1 |
    { grep -v "^WARNING: Location 'file:" || true; }
  python=python label=setup t0=$SECONDS
  . scripts/venvs.sh
  install_in .venv -q -c constraints.txt torch
  install_in .venv -q -c constraints.txt -e ".[dev,bench]" # bench: trl for tests/test_bench.py (it pulls no other torch)
  touch "$stamp"
fi
