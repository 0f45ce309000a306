# Shared by scripts/peers.sh and scripts/envs.sh (sourced): a venv per package under $root, built once per pin set.
# The caller sets root, python, label (the log prefix) and stamp (the file in a ready env holding its pins).

say() { printf '[%s %4ds] %s\n' "$label" $((SECONDS - t0)) "$*"; }

# --no-compile: pip would byte-compile every module of every package (torch, vLLM, SGLang: ~160 s of the
# ~345 s a cold build of both peers took beside a benchmark); Python compiles the modules a server imports on
# its first start instead (~4-6 s each, measured with -X pycache_prefix).
pip_in() { # pip in env $1, its output without the local mirrors' "ignored location" noise
  local env=$1
  shift
  "$env/bin/python" -m pip install --disable-pip-version-check --progress-bar off --no-compile "$@" 2>&1 |
    { grep -v -e "^WARNING: Location 'file:" -e '^Requirement already satisfied' || true; } # pipefail: pip's status
}

build() { # build NAME PINS STEP-FUNCTION: kept when its stamp holds PINS, completed when partial, else rebuilt
  local env="$root/$1" pins=$2 step=$3
  if [ -f "$env/$stamp" ] && [ "$(cat "$env/$stamp")" = "$pins" ]; then
    say "$1: ready ($env)"
    return
  fi
  exec 9>"$root/.$1.lock"
  flock 9 # one build per env at a time (another shell may be building it)
  if [ -f "$env/$stamp" ] && [ "$(cat "$env/$stamp")" = "$pins" ]; then
    say "$1: ready ($env)"
    return
  fi
  if [ -f "$env/$stamp" ]; then
    say "$1: built from other pins ($(tr '\n' ' ' <"$env/$stamp")): rebuilding"
    rm -rf "$env"
  fi
  if [ ! -x "$env/bin/python" ]; then
    say "$1: creating the venv $env"
    "$python" -m venv "$env"
  else
    say "$1: completing the install in $env"
  fi
  "$step" "$env"
  printf '%s\n' "$pins" >"$env/$stamp"
  say "$1: ready ($env, $(du -sh "$env" | cut -f1))"
  exec 9>&-
}
