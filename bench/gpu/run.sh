#!/usr/bin/env bash
# The prepared device check for a lent GPU (see bench/gpu/run.py): its image's python3 holds torch and
# transformers; our code comes with the working tree. Ends within the 8 minutes budgeted for it.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 470 python3 bench/gpu/run.py --json "${OUT:-/tmp}/gpu.json" "$@"
