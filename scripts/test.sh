#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/peers.sh  # real SGLang / vLLM for the real_peers tests (cached; minutes the first time)
. .venv/bin/activate
# tests/test_inspect.py drives the inspector page in Debian's chromium (headless); CI runs as root
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
ruff format --check --quiet . && ruff check --quiet . && mypy  # files and settings: [tool.mypy] in pyproject.toml
python -m pytest -q "$@"
