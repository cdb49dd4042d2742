#!/usr/bin/env bash
# Runs fullshard's tests on another torch release, in a venv of its own:
#
#   bash scripts/compat.sh 2.15.0            # the whole suite
#   bash scripts/compat.sh 2.9.1 --subset    # what CI runs on the oldest and newest torch
#   bash scripts/compat.sh 2.11.0 --gpu-check  # scripts/gpu_check.sh --dry-run on that torch
#   bash scripts/compat.sh 2.15.0 -- tests/test_fsdp2_compat.py -k patch   # any pytest arguments
#
# COMPAT_PINS="transformers==5.17.0 accelerate==1.15.0" holds those packages at those releases
# in the venv too (CI mirrors the GPU image's packages that way for --gpu-check).
#
# The venv is cached in ${FULLSHARD_COMPAT_CACHE:-~/.cache/fullshard}/venv-torch-VERSION and
# rebuilt when it is missing, broken, or made for another pyproject.toml or other pins. It
# never touches .venv (the pinned torch). On a CPU-only machine torch releases other than the
# CPU wheel on disk come from PyPI as the CUDA build (about 5 GB, one to a few minutes); pip's
# machine-wide configuration (which may cap torch at what lies on disk) is bypassed for this
# venv only, through PIP_CONFIG_FILE=/dev/null.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: bash scripts/compat.sh TORCH_VERSION [--subset | --gpu-check | -- PYTEST_ARGS...]" >&2
  exit 2
fi
VERSION=$1
shift

# The engine parity matrix, FSDP2 conformance and misuse (behaviours compared with FSDP2 on
# that torch too), the torch range's refusals, the framework clients (pipelining, Accelerate,
# Fabric, transformers, DCP; Accelerate and the Trainer on FSDP1), checkpoints (FSDP1's too),
# composition, the install, the backend plan, the stream-order checker and fullshard.rl (the
# RL stacks ship torch 2.9-2.11: weight sync, sleep/wake, FSDP2's private names as they are),
# TP gradients reduced in reduce_dtype, the all-reduce hook's stream, every order of backward
# hooks and the traps FSDP2's users reported (what FSDP2 does there is asserted per release).
SUBSET=(tests/test_engine.py tests/test_fsdp2_compat.py tests/test_fsdp2_misuse.py
        tests/test_torch_range.py tests/test_torch215_api.py tests/clients
        tests/test_engine_knobs.py tests/test_features.py tests/test_checkpoint.py
        tests/test_composition.py tests/test_install.py tests/test_conformance.py
        tests/test_frozen.py tests/test_backend_plan.py tests/test_stream_order.py
        tests/test_labels.py tests/test_states.py tests/test_chunked_loss.py tests/test_fsdp1.py
        tests/test_fsdp1_api.py tests/test_fsdp1_checkpoint.py tests/test_rl_sync.py
        tests/test_rl_sleep.py tests/test_rl_private_names.py tests/test_tp_reduce_dtype.py
        tests/test_all_reduce_hook_stream.py tests/test_fsdp2_traps.py
        tests/test_backward_orders.py tests/test_fsdp1_writeback.py)
MODE=pytest
ARGS=(tests)
if [ $# -gt 0 ]; then
  case "$1" in
    --subset) ARGS=("${SUBSET[@]}"); shift ;;
    --gpu-check) MODE=gpu_check; shift ;;
    --) shift; ARGS=("$@"); set -- ;;
    *) echo "compat.sh: unknown argument $1 (expected --subset, --gpu-check or -- PYTEST_ARGS)" >&2
       exit 2 ;;
  esac
fi

CACHE=${FULLSHARD_COMPAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fullshard}
VENV="$CACHE/venv-torch-$VERSION"
PY=${PYTHON:-python3}
PINS=${COMPAT_PINS:-}
want_stamp="torch=$VERSION pins=[$PINS] $(sha256sum pyproject.toml | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.fullshard-stamp" 2>/dev/null)" != "$want_stamp" ] \
   || ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "compat.sh: building $VENV (torch $VERSION${PINS:+, $PINS})"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  # torch and the pins hold where they are while the extras resolve (a client that needs a
  # newer torch resolves to an older release of that client instead).
  printf '%s\n' "torch==$VERSION" $PINS > "$VENV/constraints.txt"
  # Only this venv bypasses the machine's pip configuration (and so any cap on torch); with
  # setuptools new enough to build fullshard's wheel (tests/test_install.py builds one without
  # build isolation; older torch releases do not pull a recent setuptools in themselves).
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q -c "$VENV/constraints.txt" \
    "torch==$VERSION" "setuptools>=68" wheel
  PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q -c "$VENV/constraints.txt" \
    -e ".[dev,clients]" $PINS
  echo "$want_stamp" > "$VENV/.fullshard-stamp"
fi
# The cached venv may have been made from another clone: point fullshard at this one.
PIP_CONFIG_FILE=/dev/null "$VENV/bin/pip" install -q --no-deps -e .

got=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$got" != "$VERSION" ]; then
  echo "compat.sh: $VENV has torch $got, not $VERSION; remove it and run again" >&2
  exit 1
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$MODE" = gpu_check ]; then
  out=$(mktemp -d)
  echo "compat.sh: torch $got ($VENV), scripts/gpu_check.sh --dry-run --out $out"
  PYTHON="$VENV/bin/python" bash scripts/gpu_check.sh --dry-run --out "$out"
  exit $?
fi
echo "compat.sh: torch $got ($VENV), pytest ${ARGS[*]}"
exec "$VENV/bin/python" -m pytest -q -x "${ARGS[@]}"
