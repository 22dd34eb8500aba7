#!/usr/bin/env bash
# Session 17 (world 2): build, then `verify` part $P, or `compare` (P=c), on the checked-out commit.
#   P=1|2|c BUDGET=seconds COMMIT=sha bash diag/w10/call.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/m$P
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/m$P/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
left=$(( ${BUDGET:-585} - SECONDS - 12 ))
if [[ $P == c ]]; then
  SKIP_BUILD=1 DEADLINE=$left timeout $left bash scripts/gpu_check.sh compare $OUT/m$P/v >$OUT/m$P/v.log 2>&1
else
  SKIP_BUILD=1 COMMIT=$COMMIT PART=$P TEST_TIMEOUT=170 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/m$P/v >$OUT/m$P/v.log 2>&1
fi
echo "rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:|compare|exit" $OUT/m$P/v/summary.txt | cut -c1-220
tar -czf $OUT/m$P.tgz -C $OUT m$P && rm -rf $OUT/m$P
