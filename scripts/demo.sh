#!/usr/bin/env bash
# Set up (if needed) and run the CPU demo: SFT warm start, then GRPO, on a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
relayrl demo "$@"
