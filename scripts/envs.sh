#!/usr/bin/env bash
# Build (if needed) the OpenEnv and verifiers environments the environment-adapter tests run against
# (tests/real_peers/test_openenv.py and test_verifiers.py, docs/environments.md). One venv per package, pinned in scripts/envs.env, under
#   ${RELAYRL_ENVS_DIR:-$HOME/.cache/relayrl-envs}/{openenv-core-<version>,verifiers-<version>}
# Both conflict with relayrl's pins (openenv-core's gradio wants pillow<13, verifiers wants openai<3), so
# their environments run out of process and relayrl talks to them over the wire.
# - openenv: openenv-core from PyPI, then `openenv init echo_env` writes the template environment into
#   <env>/envs/echo_env (offline; its server is started by the tests with the venv's python).
# - verifiers: verifiers from PyPI (its harness calls relayrl's AgentProxy as an OpenAI endpoint).
# Idempotent like scripts/peers.sh: a ready env whose stamp holds the current pins is kept, a partial one
# completed, one built from other pins rebuilt. `scripts/envs.sh openenv` (or verifiers) builds one.
# About 20 s each the first time with uv (1-2 minutes with pip); seconds once built.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/envs.env
root="${RELAYRL_ENVS_DIR:-$HOME/.cache/relayrl-envs}"
python="${RELAYRL_ENVS_PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
mkdir -p "$root"
t0=$SECONDS

label=envs stamp=.relayrl-env
. scripts/venvs.sh

openenv_step() {
  local env=$1
  say "openenv: installing openenv-core==$OPENENV_CORE_VERSION"
  install_in "$env" -q "openenv-core==$OPENENV_CORE_VERSION"
  say "openenv: openenv init echo_env (the template environment, offline)"
  rm -rf "$env/envs/echo_env"
  mkdir -p "$env/envs"
  (cd "$env/envs" && "$env/bin/openenv" init echo_env >/dev/null 2>&1) || {
    (cd "$env/envs" && "$env/bin/openenv" init echo_env) # again, to show why
    return 1
  }
  (cd "$env/envs" && "$env/bin/python" -c "from echo_env.server.app import app; print('openenv echo_env app', app.title)")
}

verifiers_step() {
  local env=$1 script
  say "verifiers: installing verifiers==$VERIFIERS_VERSION uv==$VERIFIERS_UV_VERSION"
  install_in "$env" -q "verifiers==$VERIFIERS_VERSION" "uv==$VERIFIERS_UV_VERSION"
  "$env/bin/python" -c "import importlib.metadata as m, verifiers; print('verifiers', m.version('verifiers'))"
  # The null/bash harnesses run a PEP 723 chat program through `uv sync --script` (openai, mcp, httpx ...
  # from PyPI) at their first episode; do it now, at the path verifiers uses, so episodes find it cached.
  script=$("$env/bin/python" -c "
import hashlib, pathlib
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessRuntime
d = pathlib.Path(SubprocessRuntime.scripts_dir)
d.mkdir(parents=True, exist_ok=True)
p = d / (hashlib.sha256(CHAT_PROGRAM_SOURCE.encode()).hexdigest() + '.py')
p.write_text(CHAT_PROGRAM_SOURCE)
print(p)")
  say "verifiers: uv sync --script $script (the harness's chat program)"
  PATH="$env/bin:$PATH" UV_OFFLINE=false uv sync --script "$script" -q --no-config
}

want="${1:-all}" # scripts/envs.sh [openenv|verifiers]: one of them only
case "$want" in all | openenv | verifiers) ;; *) echo "usage: scripts/envs.sh [openenv|verifiers]" >&2 && exit 2 ;; esac
[ "$want" = verifiers ] || build "openenv-core-$OPENENV_CORE_VERSION" "openenv-core==$OPENENV_CORE_VERSION" openenv_step
[ "$want" = openenv ] || build "verifiers-$VERIFIERS_VERSION" "verifiers==$VERIFIERS_VERSION uv==$VERIFIERS_UV_VERSION" verifiers_step
say "done: $root"
