#!/usr/bin/env bash
# The GPU check: fullshard vs torch FSDP2 on one CUDA GPU, one table (benchmarks/gpu_check.py).
#   bash scripts/gpu_check.sh [--out gpu_check.json] [--trace-dir DIR] [--llama-layers N] ...
# Under 8 minutes on one H200. Without a CUDA GPU it prints one line saying it skipped, exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# A hard ceiling well inside the 8-minute budget; a hung collective fails instead of stalling.
exec timeout --kill-after=10 450 "$py" benchmarks/gpu_check.py "$@"
