#!/usr/bin/env bash
# Session 15 (world 2): main's verification, PART given by $P (1: tests/gpu and the examples; 2: every sweep and step).
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/m$P
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/m$P/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
left=$(( ${BUDGET:-585} - SECONDS - 12 ))
SKIP_BUILD=1 COMMIT=$COMMIT PART=$P TEST_TIMEOUT=170 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/m$P/v >$OUT/m$P/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/m$P/v/summary.txt | cut -c1-200
tar -czf $OUT/m$P.tgz -C $OUT m$P && rm -rf $OUT/m$P
