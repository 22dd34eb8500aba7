#!/usr/bin/env bash
# World 2, second call of session 14: tests/gpu again (the test fix), verify part 2, then the comparison.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/w6b
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/w6b/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SKIP_BUILD=1 COMMIT=$COMMIT PART=1 ONLY=tests_gpu TEST_TIMEOUT=170 timeout 200 bash scripts/gpu_check.sh verify $OUT/w6b/t >$OUT/w6b/t.log 2>&1
echo "tests_gpu rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/w6b/t/summary.txt | cut -c1-200
left=$(( ${BUDGET:-590} - SECONDS - 12 ))
SKIP_BUILD=1 COMMIT=$COMMIT PART=2 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/w6b/v >$OUT/w6b/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/w6b/v/summary.txt | cut -c1-200
left=$(( ${BUDGET:-590} - SECONDS - 12 ))
if (( left > 110 )); then
  SKIP_BUILD=1 COMMIT=$COMMIT DEADLINE=$left timeout $left bash scripts/gpu_check.sh compare $OUT/w6b/c >$OUT/w6b/c.log 2>&1
  echo "compare rc $? at ${SECONDS}s"; grep -E "auto slower|#wrong" $OUT/w6b/c/summary.txt $OUT/w6b/c.log 2>/dev/null | head -12 | cut -c1-160
else echo "compare not run: ${left}s left"; fi
tar -czf $OUT/w6b.tgz -C $OUT w6b && rm -rf $OUT/w6b
