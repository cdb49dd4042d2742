#!/usr/bin/env bash
# Creates .venv (if missing) and installs fullshard with its dev, clients, ft and peers extras.
# Without a GPU it installs PyTorch's CPU wheel first, so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.6"
  else
    # The CPU wheel: 2.13.0 lies on disk on our machines, so this downloads nothing.
    .venv/bin/pip install -q torch==2.13.0
  fi
fi
# torch is installed above, so resolving the extras keeps it (no CUDA build is pulled); the
# peers extra (DeepSpeed, for `fullshard bench --modes deepspeed` and its test) and the ft
# extra (torchft, for tests/test_torchft.py) are installed under a constraint that holds torch
# at the installed version, so they cannot move torch either.
.venv/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" \
  > .venv/torch-constraint.txt
.venv/bin/pip install -q -c .venv/torch-constraint.txt -e ".[dev,clients,ft,peers]"
