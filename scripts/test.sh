#!/usr/bin/env bash
# Set up (if needed) and run the test suite: what CI runs through .ci/run (docs/testing.md says where the time goes).
#   bash scripts/test.sh          the main suite on both cores with lint beside it, then the real SGLang / vLLM suite
#   bash scripts/test.sh --all    the same plus the minutes-long number checks (marker `long`: the full demo,
#                                 the benchmarks' quick runs, the soak); each has a short counterpart in CI
#   bash scripts/test.sh ARGS...  one pytest run of ARGS (e.g. tests/test_staleness.py -x; add -n 2 for workers)
# The real-peer environments (scripts/peers.sh: ~1 minute the first time, with uv) and the OpenEnv /
# verifiers ones (scripts/envs.sh, ~20 s each) are built in the background while the main suite runs.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
phase() { printf '[test.sh %4ds] %s\n' $((SECONDS - t0)) "$*"; }
bash scripts/setup.sh
. .venv/bin/activate
# tests/test_inspect.py drives the inspector page in Debian's chromium (headless); CI runs as root
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  phase "installing Debian's chromium for the inspector's browser tests"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# mypy's cache beside pip's: mypy matches files by content, so a fresh clone reuses it (~100 s of CPU cold, ~5 s warm)
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/relayrl/mypy}"

markers="not real_peers and not long" peer_markers="real_peers and not long"
if [ "${1:-}" = --all ]; then
  markers="not real_peers" peer_markers="real_peers"
  shift
fi
if [ $# -gt 0 ]; then
  bash scripts/peers.sh # real SGLang / vLLM for any real_peers test selected (cached; ~1 minute the first time)
  bash scripts/envs.sh  # OpenEnv / verifiers for the environment adapters' tests (cached; ~20 s each the first time)
  exec python -m pytest -q "$@"
fi

peers_log=$(mktemp -t relayrl-peers.XXXXXX.log) peer_suite_log=$(mktemp -t relayrl-peer-suite.XXXXXX.log)
# The real-peer suite runs beside the main suite (one worker): its tests mostly wait on servers (start-up,
# generation), so the two suites fill each other's idle time on the two cores. It starts once its
# environments are built and the main suite's Ray file is done (tests/conftest.py BEFORE_PEER_SUITE touches
# the gate; Ray slows ~4x with three processes on two cores), or when the main suite ends. Its output is
# printed once the main suite is done.
export RELAYRL_PEER_SUITE_GATE="$peer_suite_log.gate"
rm -f "$RELAYRL_PEER_SUITE_GATE"
{
  if bash scripts/peers.sh && bash scripts/envs.sh; then
    phase "real-peer environments ready; waiting for the main suite's Ray file"
    while [ ! -e "$RELAYRL_PEER_SUITE_GATE" ]; do sleep 2; done
    phase "the real-peer suite starts beside the main suite"
    python -m pytest -q -n "${RELAYRL_PEER_WORKERS:-1}" --dist loadfile --no-loadscope-reorder --durations=8 \
      -p no:cacheprovider -m "$peer_markers" >"$peer_suite_log" 2>&1
  else
    echo "scripts/peers.sh or scripts/envs.sh failed: the real-peer suite did not run"
    exit 1
  fi
} >>"$peers_log" 2>&1 &
peers=$!
phase "set-up done; building the real-peer environments in the background (log: $peers_log)"
status=0
# Lint runs beside the main suite (a cold mypy cache is ~70 s of one core; warm, a few seconds) and is
# reported after it. Each check is its own command: under `set -e` a failure inside an `a && b && c` list
# does not stop the script, so each status is kept instead (a lint failure fails CI; the tests still run).
lint_log=$(mktemp -t relayrl-lint.XXXXXX.log)
{
  lint_status=0
  for lint in "ruff format --check --quiet ." "ruff check --quiet ." "mypy"; do # mypy's files and settings: [tool.mypy]
    $lint || { echo "lint failed: $lint"; lint_status=1; }
  done
  exit "$lint_status"
} >"$lint_log" 2>&1 &
linting=$!
# Two workers (one torch thread each); a file's tests stay on one worker, so module fixtures are built once.
python -m pytest -q -n "${RELAYRL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=20 -m "$markers" || status=$?
phase "main suite done"
lint_status=0
wait "$linting" || lint_status=$?
cat "$lint_log"
[ "$lint_status" = 0 ] || status=1
phase "lint done (exit $lint_status)"
touch "$RELAYRL_PEER_SUITE_GATE" # the real-peer suite starts now if the Ray file did not run
peer_status=0
wait "$peers" || peer_status=$?
grep -E '^\[test.sh' "$peers_log" || true
if [ -s "$peer_suite_log" ]; then cat "$peer_suite_log"; else cat "$peers_log"; fi
[ "$peer_status" = 0 ] || status=1
phase "real-peer suite done (exit $peer_status)"
phase "total (exit $status)"
exit "$status"
