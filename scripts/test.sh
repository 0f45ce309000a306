#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow tests and the real SGLang / vLLM tests included.
# With arguments, they go to one pytest run (e.g. `bash scripts/test.sh tests/test_staleness.py -x`).
# Without, the real-peer environments (scripts/peers.sh: downloads, ~10 minutes the first time) are built
# in the background while the main suite runs, then the real-peer suite (-m real_peers) runs on them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# tests/test_inspect.py drives the inspector page in Debian's chromium (headless); CI runs as root
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the inspector's browser tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
ruff format --check --quiet . && ruff check --quiet . && mypy # files and settings: [tool.mypy] in pyproject.toml

if [ $# -gt 0 ]; then
  bash scripts/peers.sh # real SGLang / vLLM for any real_peers test selected (cached; minutes the first time)
  exec python -m pytest -q "$@"
fi

peers_log=$(mktemp -t relayrl-peers.XXXXXX.log)
bash scripts/peers.sh >"$peers_log" 2>&1 &
peers=$!
echo "building the real-peer environments in the background (log: $peers_log)"
status=0
python -m pytest -q --durations=15 -m "not real_peers" || status=$?
if wait "$peers"; then
  tail -n 3 "$peers_log"
  python -m pytest -q --durations=5 -m real_peers || status=$?
else
  cat "$peers_log"
  echo "scripts/peers.sh failed: the real-peer suite did not run" >&2
  status=1
fi
exit "$status"
