#!/usr/bin/env bash
# Final call G1 (2026-11-28 session 5), nvidia-h200-x2, world 2 on the final commit: tests/gpu
# and the six examples (scripts/gpu_check.sh verify, part 1).
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?} TEST_TIMEOUT=240
mkdir -p "$OUT/g1"; F=$OUT/g1
DEADLINE=570 PART=1 bash scripts/gpu_check.sh verify "$F/v" >"$F/verify_screen.txt" 2>&1
echo "verify part 1: done at $((SECONDS-T0)) s"; tail -14 "$F/verify_screen.txt"
tar -czf "$OUT/g1.tgz" -C "$OUT" g1 build.log && rm -rf "$F"
