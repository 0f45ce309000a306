#!/usr/bin/env bash
# scripts/gpu_check.sh proven without a GPU: a Python 3.12 venv standing in for the GPU image (PyPI's
# torch 2.11.0, transformers 5.17.0 and the rest of what relayrl takes from the image, at the versions in
# .gpu-wheels/FROM_IMAGE.txt), then gpu_check.sh run on it with no index and no pip configuration:
# relayrl installs from .gpu-wheels without touching torch, `relayrl selftest` passes on CPU, the gpu
# tests skip and bench/gpu.py says it needs CUDA. Deadlines are 300 s a stage here: a shared 2-core machine.
#   bash scripts/gpu_proof.sh [OUT_DIR]   # first time: ~3 GB of downloads (PyPI's torch is its CUDA build)
# The venv is cached in ${RELAYRL_GPU_PROOF_DIR:-~/.cache/relayrl-gpu-proof}/img312 (rebuilt when
# FROM_IMAGE.txt changes). Runs scripts/gpu_wheels.sh first if .gpu-wheels is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .gpu-wheels/FROM_IMAGE.txt ] || bash scripts/gpu_wheels.sh
root="${RELAYRL_GPU_PROOF_DIR:-$HOME/.cache/relayrl-gpu-proof}"
venv="$root/img312"
py312="${PYTHON312:-$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | tail -n 1 || true)}"
want="$(cat .gpu-wheels/FROM_IMAGE.txt) pytest pytest-timeout"
if [ ! -f "$venv/.image" ] || [ "$(cat "$venv/.image")" != "$want" ]; then
  echo "gpu_proof: building the stand-in image venv $venv"
  rm -rf "$venv"
  "${py312:-python3.12}" -m venv "$venv"
  # exactly the image's side (--no-deps: nothing the image may lack slips in), then the test runner
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r .gpu-wheels/FROM_IMAGE.txt 2>&1 |
    { grep -v "^WARNING: Location 'file:" || true; }
  "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest pytest-timeout 2>&1 |
    { grep -v "^WARNING: Location 'file:" || true; }
  printf '%s' "$want" >"$venv/.image"
fi
out="$(realpath -m "${1:-$(mktemp -d -t relayrl-gpu-proof.XXXXXX)}")"
echo "gpu_proof: scripts/gpu_check.sh with $venv/bin/python, no index; results in $out"
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
  GPU_CHECK_INSTALL_S=300 GPU_CHECK_SELFTEST_S=300 GPU_CHECK_PYTEST_S=300 GPU_CHECK_BENCH_S=300 \
  PYTHON="$venv/bin/python" OUT="$out" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" bash scripts/gpu_check.sh
