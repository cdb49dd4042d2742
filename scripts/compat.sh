#!/usr/bin/env bash
# Runs fullshard's tests on another torch release, in a venv of its own:
#
#   bash scripts/compat.sh 2.15.0            # the whole suite
#   bash scripts/compat.sh 2.15.0 --subset   # what CI runs on the newest torch (see SUBSET below)
#   bash scripts/compat.sh 2.15.0 -- tests/test_fsdp2_compat.py -k patch   # any pytest arguments
#
# The venv is cached in ${FULLSHARD_COMPAT_CACHE:-~/.cache/fullshard}/venv-torch-VERSION and
# rebuilt when it is missing or broken. It never touches .venv (the pinned torch). On a CPU-only
# machine torch releases newer than the CPU wheel on disk come from PyPI as the CUDA build (about
# 5 GB, one to a few minutes); pip's machine-wide configuration (which may cap torch at what lies
# on disk) is bypassed for this venv only, through PIP_CONFIG_FILE=/dev/null.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: bash scripts/compat.sh TORCH_VERSION [--subset | -- PYTEST_ARGS...]" >&2
  exit 2
fi
VERSION=$1
shift

# The engine parity matrix, FSDP2 conformance (behaviours compared with FSDP2 on that torch
# too), the framework clients (pipelining, Accelerate, Fabric, transformers, DCP), the backend
# plan and the stream-order checker.
SUBSET=(tests/test_engine.py tests/test_fsdp2_compat.py tests/test_torch215_api.py tests/clients
        tests/test_engine_knobs.py tests/test_features.py tests/test_checkpoint.py
        tests/test_composition.py tests/test_install.py tests/test_conformance.py
        tests/test_frozen.py tests/test_backend_plan.py tests/test_stream_order.py
        tests/test_labels.py tests/test_states.py)
ARGS=(tests)
if [ $# -gt 0 ]; then
  case "$1" in
    --subset) ARGS=("${SUBSET[@]}"); shift ;;
    --) shift; ARGS=("$@"); set -- ;;
    *) echo "compat.sh: unknown argument $1 (expected --subset or -- PYTEST_ARGS)" >&2; exit 2 ;;
  esac
fi

CACHE=${FULLSHARD_COMPAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fullshard}
VENV="$CACHE/venv-torch-$VERSION"
PY=${PYTHON:-python3}
want_stamp="torch=$VERSION $(sha256sum pyproject.toml | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.fullshard-stamp" 2>/dev/null)" != "$want_stamp" ] \
   || ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "compat.sh: building $VENV (torch $VERSION)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  # Only this venv bypasses the machine's pip configuration (and so any cap on torch).
  # setuptools new enough to build fullshard's wheel (tests/test_install.py builds one without
  # build isolation; older torch releases do not pull a recent setuptools in themselves)
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q "torch==$VERSION" "setuptools>=68" wheel
  # torch is installed first and held there by a constraint, so resolving the extras keeps it
  # (a client that needs a newer torch resolves to an older release of that client instead).
  echo "torch==$VERSION" > "$VENV/torch-constraint.txt"
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q -c "$VENV/torch-constraint.txt" \
    -e ".[dev,clients]"
  echo "$want_stamp" > "$VENV/.fullshard-stamp"
fi
# The cached venv may have been made from another clone: point fullshard at this one.
PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q --no-deps -e .

got=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$got" != "$VERSION" ]; then
  echo "compat.sh: $VENV has torch $got, not $VERSION; remove it and run again" >&2
  exit 1
fi
echo "compat.sh: torch $got ($VENV), pytest ${ARGS[*]}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m pytest -q -x "${ARGS[@]}"
