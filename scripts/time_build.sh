#!/usr/bin/env bash
# Times csrc/'s build in this checkout, in place: the single nvcc call that setup.py made before
# issue 24 (every unit in one process), then setup.py's build cold (its object cache and build/
# emptied) and warm (nothing changed), ROUNDS times, interleaved so that a busy spell of the
# machine lands on each kind. Prints the cores, nvcc and the load with every round.
#
#   bash scripts/time_build.sh [ROUNDS]      (default 2; PYTHON=python3 picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROUNDS=${1:-2}
ARCHS=${SYMCOMM_CUDA_ARCHS:-"-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

seconds() {  # seconds CMD...: the wall time of CMD, its output kept for a failure
  local start=$EPOCHREALTIME
  if ! "$@" >"$TMP/log" 2>&1; then cat "$TMP/log" >&2; echo "FAILED: $*" >&2; exit 1; fi
  echo "$start $EPOCHREALTIME" | awk '{printf "%.1f", $2 - $1}'
}

echo "build timing: $(nproc) cores, $(nvcc --version | tail -1), $($PY -c 'import platform; print(platform.node())')"
for round in $(seq "$ROUNDS"); do
  # shellcheck disable=SC2086 # ARCHS is a list of flags
  before=$(seconds nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC $ARCHS csrc/*.cu csrc/*.cc -o "$TMP/one_call.so")
  rm -rf build
  cold=$(seconds "$PY" -m pip install --no-build-isolation --no-deps -e .)
  warm=$(seconds "$PY" -m pip install --no-build-isolation --no-deps -e .)
  echo "round $round: one nvcc call (before) $before s | pip install -e . cold $cold s, warm $warm s | load $(cut -d' ' -f1-3 /proc/loadavg)"
done
