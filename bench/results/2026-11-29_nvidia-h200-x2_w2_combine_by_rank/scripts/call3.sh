#!/usr/bin/env bash
# Session 15, call 3 (world 2): verify part 2 (every sweep, layer and train steps), then the comparison.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/c3
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/c3/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
left=$(( ${BUDGET:-590} - SECONDS - 12 ))
SKIP_BUILD=1 COMMIT=$COMMIT PART=2 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/c3/v >$OUT/c3/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/c3/v/summary.txt | cut -c1-200
left=$(( ${BUDGET:-590} - SECONDS - 12 ))
if (( left > 110 )); then
  SKIP_BUILD=1 COMMIT=$COMMIT DEADLINE=$left timeout $left bash scripts/gpu_check.sh compare $OUT/c3/c >$OUT/c3/c.log 2>&1
  echo "compare rc $? at ${SECONDS}s"; grep -E "auto slower|#wrong" $OUT/c3/c/summary.txt $OUT/c3/c.log 2>/dev/null | head -12 | cut -c1-160
else echo "compare not run: ${left}s left"; fi
tar -czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3
