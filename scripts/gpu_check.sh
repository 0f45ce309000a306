#!/usr/bin/env bash
# The one command run on a lent GPU machine (docs/devices.md): installs relayrl beside the image's own
# torch with no index, then runs `relayrl selftest`, `pytest -m gpu` and `bench/gpu.py`, each under a
# deadline (about 8 minutes in all), writing JSON for each and a summary.
#   bash scripts/gpu_check.sh            # on the GPU machine, from the repo root
# Install: relayrl (built from this tree) and the wheels in $RELAYRL_WHEELS (.gpu-wheels, made here by
# scripts/gpu_wheels.sh) that the interpreter lacks go with --no-deps --no-index into a folder of their
# own put on PYTHONPATH: no package of the interpreter's changes (torch's version and file are checked
# before and after) and `pip check` over the combined set is recorded.
# Writes to $OUT (the device tool's) or else bench/results/: gpu_check.json (the summary),
# gpu_selftest.json, gpu_tests.json, gpu.json (bench/gpu.py), gpu_check.log (every stage's output).
# Settings: PYTHON (python3), RELAYRL_WHEELS, deadlines GPU_CHECK_INSTALL_S (60), GPU_CHECK_SELFTEST_S (100),
# GPU_CHECK_PYTEST_S (120), GPU_CHECK_BENCH_S (180) (7.7 minutes in all), GPU_CHECK_BENCH_ARGS (--repeats 1). Exit 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
wheels="$(realpath -m "${RELAYRL_WHEELS:-.gpu-wheels}")"
out="$(realpath -m "${OUT:-bench/results}")"
work="$(mktemp -d -t relayrl-gpu-check.XXXXXX)"
site="$work/site"
mkdir -p "$out" "$site"
log="$out/gpu_check.log"
: >"$log"
t0=$SECONDS
stages=()

say() { printf '[gpu_check %4ds] %s\n' $((SECONDS - t0)) "$*" | tee -a "$log"; }

stage() {  # stage NAME SECONDS COMMAND...: run under a deadline (the whole process group is killed), record rc and time
  local name=$1 limit=$2 s=$SECONDS rc
  shift 2
  say "$name: $* (deadline ${limit}s)"
  timeout -k 15 "$limit" "$@" >>"$log" 2>&1 </dev/null
  rc=$?
  say "$name: exit $rc after $((SECONDS - s))s$([ $rc = 124 ] || [ $rc = 137 ] && echo ' (deadline passed)')"
  stages+=("$name=$rc=$((SECONDS - s))")
  return $rc
}

torch_id() { timeout -k 5 120 "$py" -c 'import torch; print(torch.__version__, torch.__file__)' 2>&1; }

# 1. install: relayrl and only the wheels the interpreter lacks, into $site
[ -f "$wheels/MANIFEST.txt" ] || say "no $wheels/MANIFEST.txt: run scripts/gpu_wheels.sh where PyPI is reachable and carry the folder"
torch_before=$(torch_id)
say "python: $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])'); torch: $torch_before"
timeout -k 5 120 "$py" -m pip check >"$work/pip-check-before.txt" 2>&1
lacking=$("$py" - "$wheels" <<'EOF'
import importlib.metadata as md, pathlib, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = w.name.split("-")[0]
    if name.lower() == "setuptools":
        continue  # relayrl's build backend: pip takes it from --find-links for the build only
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(w)
EOF
)
mkdir -p "$work/src"  # relayrl built from a copy: no build/ or egg-info left in the tree
cp -r pyproject.toml README.md relayrl "$work/src/"
# shellcheck disable=SC2086  # $lacking: one wheel path per word
stage install "${GPU_CHECK_INSTALL_S:-60}" env PIP_CONFIG_FILE=/dev/null "$py" -m pip install --no-index --find-links "$wheels" --no-deps \
  --no-compile --disable-pip-version-check --target "$site" "$work/src" $lacking
install_rc=$?
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
torch_after=$(torch_id)
timeout -k 5 120 "$py" -m pip check >"$work/pip-check-after.txt" 2>&1
relayrl_from=$(cd "$work" && timeout -k 5 120 "$py" -c 'import relayrl; print(relayrl.__file__)' 2>&1)
say "relayrl from: $relayrl_from; torch after: $torch_after; pip check: $(tail -n 1 "$work/pip-check-after.txt")"

# 2. the three checks (each skipped only when the install failed)
if [ $install_rc = 0 ]; then
  # from $work: the relayrl imported is the installed one, not this tree's
  stage selftest "${GPU_CHECK_SELFTEST_S:-100}" env -C "$work" relayrl selftest --out "$out/gpu_selftest.json"
  gpu_files=$(grep -l 'mark.gpu' tests/test_*.py | tr '\n' ' ')
  # shellcheck disable=SC2086
  stage pytest_gpu "${GPU_CHECK_PYTEST_S:-120}" "$py" -m pytest -m gpu -q -p no:cacheprovider --timeout=90 \
    --junitxml="$work/junit.xml" $gpu_files
  # shellcheck disable=SC2086
  stage bench_gpu "${GPU_CHECK_BENCH_S:-180}" env BENCH_RESULTS_DIR="$out" "$py" bench/gpu.py ${GPU_CHECK_BENCH_ARGS:---repeats 1}
fi

# 3. the summary: gpu_tests.json from pytest's JUnit XML, gpu_check.json, a table on stdout
"$py" - "$out" "$work" "$install_rc" "$torch_before" "$torch_after" "$relayrl_from" "${stages[@]}" <<'EOF'
import json, pathlib, platform, sys, xml.etree.ElementTree as ET
out, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
install_rc, torch_before, torch_after, relayrl_from, *stages = sys.argv[3:]
junit = work / "junit.xml"
if junit.exists():
    cases = []
    for c in ET.parse(junit).getroot().iter("testcase"):
        kind = next((x.tag for x in c if x.tag in ("failure", "error", "skipped")), "passed")
        detail = next((x.get("message", "") for x in c if x.tag in ("failure", "error", "skipped")), "")
        cases.append({"test": f"{c.get('classname')}::{c.get('name')}", "outcome": kind,
                      "seconds": float(c.get("time") or 0), "detail": detail[:500]})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    (out / "gpu_tests.json").write_text(json.dumps({"counts": counts, "tests": cases}, indent=1) + "\n")
before, after = ((work / f"pip-check-{w}.txt").read_text().strip().splitlines() for w in ("before", "after"))
summary = {
    "python": platform.python_version(),
    "torch_before": torch_before, "torch_after": torch_after, "torch_untouched": torch_before == torch_after,
    "relayrl_from": relayrl_from,
    "installed": sorted(p.name for p in (work / "site").glob("*.dist-info")),
    "pip_check_new_problems": sorted(set(after) - set(before) - {"No broken requirements found."}),
    "stages": {"install": {"rc": int(install_rc)}} | {
        s.split("=")[0]: {"rc": int(s.split("=")[1]), "seconds": int(s.split("=")[2])} for s in stages if s},
}
for name, f in (("selftest", "gpu_selftest.json"), ("pytest_gpu", "gpu_tests.json"), ("bench_gpu", "gpu.json")):
    if name in summary["stages"]:
        summary["stages"][name]["json"] = str(out / f) if (out / f).exists() else None
if (out / "gpu_tests.json").exists():
    summary["stages"]["pytest_gpu"]["counts"] = json.loads((out / "gpu_tests.json").read_text())["counts"]
if (out / "gpu_selftest.json").exists():
    checks = json.loads((out / "gpu_selftest.json").read_text()).get("checks", [])
    summary["stages"]["selftest"]["counts"] = {k: sum(c.get("status") == k for c in checks) for k in ("pass", "fail", "skip")}
summary["ok"] = (all(s["rc"] == 0 for s in summary["stages"].values()) and summary["torch_untouched"]
                 and not summary["pip_check_new_problems"])
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"gpu_check: python {summary['python']}, torch {torch_after.split()[0]} "
      f"({'untouched' if summary['torch_untouched'] else 'CHANGED from ' + torch_before})")
for p in summary["pip_check_new_problems"]:
    print(f"gpu_check: pip check: {p}")
for name, s in summary["stages"].items():
    print(f"  {name:<11} rc={s['rc']:<4} {str(s.get('seconds', '')) + 's':>6}  {s.get('counts', '')}  {s.get('json') or ''}")
print(f"gpu_check: {'OK' if summary['ok'] else 'FAILED'}; summary {out / 'gpu_check.json'}, log {out / 'gpu_check.log'}")
sys.exit(0 if summary["ok"] else 1)
EOF
rc=$?
rm -rf "$work"
exit $rc
