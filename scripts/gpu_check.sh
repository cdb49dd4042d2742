#!/usr/bin/env bash
# The GPU check: fullshard vs torch FSDP2 on one CUDA GPU, one table (benchmarks/gpu_check.py).
#   bash scripts/gpu_check.sh [--out DIR] [--trace-dir DIR] [--budget-s 440] [--only KEYS] ...
#   bash scripts/gpu_check.sh --dry-run --out DIR    # every check on the CPU at tiny sizes
# Under 8 minutes on one H200, writing DIR/gpu_check.json and DIR/gpu_check.md after each check.
# Installs and downloads nothing: the machine's python3 (or $PYTHON, or .venv if there) with
# fullshard from src/ and the peers package from benchmarks/. Without a CUDA GPU it prints one
# line saying it skipped, exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
# A hard ceiling above the checks' own budget (440 s by default) and under 8 minutes: a hung
# collective fails instead of stalling; the report keeps every check finished before it.
exec timeout --kill-after=10 480 "$py" benchmarks/gpu_check.py "$@"
