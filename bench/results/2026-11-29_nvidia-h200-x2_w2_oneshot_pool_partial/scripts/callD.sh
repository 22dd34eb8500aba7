#!/usr/bin/env bash
# Diagnose call A's tests/gpu timeout: the same tree (branch oneshot-pool + the tuned table), tests/gpu
# under torchrun with faulthandler's stack dump after 80 s in one test, and a longer bound.
set -uo pipefail
export OUT=$1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/d
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/d/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 250 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  'python3 -X faulthandler -m pytest tests/gpu -q -rs -p no:cacheprovider -o faulthandler_timeout=80 --durations=15 >$OUT/d/r$RANK.log 2>&1'
echo "tests rc $? at ${SECONDS}s"
for r in 0 1; do echo "== rank $r"; grep -E "passed|failed|^FAILED|Timeout|EADDR" $OUT/d/r$r.log | head -8 | cut -c1-220; done
tar -czf $OUT/d.tgz -C $OUT d && rm -rf $OUT/d
