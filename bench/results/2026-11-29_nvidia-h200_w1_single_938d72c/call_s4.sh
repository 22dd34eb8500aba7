#!/usr/bin/env bash
# One H200: world-1 check of the reverted pool pause (nested context refused, norm bits), quickstart.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/s; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/s/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 150 torchrun --nproc-per-node=1 scripts/world1_check.py >$OUT/s/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $OUT/s/world1.txt)"
grep -E "^FAIL|nested|rmsnorm" $OUT/s/world1.txt | head
timeout 60 torchrun --nproc-per-node=1 examples/quickstart.py >$OUT/s/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
tar -czf $OUT/s4.tgz -C $OUT s && rm -rf $OUT/s
