# Shared by scripts/peers.sh and scripts/envs.sh (sourced): a venv per package under $root, built once per pin set.
# The caller sets root, python, label (the log prefix) and stamp (the file in a ready env holding its pins).

say() { printf '[%s %4ds] %s\n' "$label" $((SECONDS - t0)) "$*"; }

# The installer: uv when it is on PATH (relayrl's dev extra pins it; scripts/test.sh puts .venv/bin first),
# else pip. uv installs the same resolution as pip (checked package by package for both peers) in seconds:
# a cold build of both peers took ~30 s with uv against ~190 s with pip --no-compile, which the real-peer
# suite's start waits for on a fresh machine. Neither byte-compiles (pip would, ~160 s of CPU for torch,
# vLLM and SGLang); Python compiles the modules a server imports on its first start (~4-6 s each).
install_in() { # install into env $1: the remaining arguments are requirements (pins) and installer flags
  local env=$1
  shift
  if command -v uv >/dev/null 2>&1; then
    local settings
    mapfile -t settings < <(pip_settings_for_uv)
    uv pip install --python "$env/bin/python" --index-strategy unsafe-best-match "${settings[@]}" "$@" 2>&1 |
      { grep -v -e '^ [-+] ' -e '^ Downloaded ' -e '^Downloading ' -e '^Using Python' || true; } # its summary lines, not every package
  else
    "$env/bin/python" -m pip install --disable-pip-version-check --progress-bar off --no-compile "$@" 2>&1 |
      { grep -v -e "^WARNING: Location 'file:" -e '^Requirement already satisfied' || true; } # pipefail: pip's status
  fi
}

# uv does not read pip's configuration (pip.conf, PIP_* variables): hand it the indexes, find-links and
# constraint files pip would use here, so both installers see the same packages. --index-strategy
# unsafe-best-match above is pip's rule (the best version across all indexes, not the first index's).
pip_settings_for_uv() {
  "$python" -m pip config list 2>/dev/null | "$python" -c '
import ast, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}
seen = set()
for line in sys.stdin:
    key, _, value = line.strip().partition("=")  # scope.key=repr(value); a list: items split by newlines
    flag = flags.get(key.rpartition(".")[2])
    for item in ast.literal_eval(value).split() if flag else ():
        if (flag, item) not in seen:
            seen.add((flag, item))
            print(flag)
            print(item)
'
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
