#!/usr/bin/env bash
# World 2, second call of session 13: verify part 2 (every symcomm-bench sweep --algo all with #wrong 0,
# moe eager, the layer steps, train_step), then issue 36's comparison (nccl-tests, PyTorch, symcomm). The build is the first call's, if the machine stayed warm.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/w3b
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/w3b/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
left=$(( ${BUDGET:-585} - SECONDS - 12 ))
SKIP_BUILD=1 COMMIT=$COMMIT PART=2 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/w3b/v >$OUT/w3b/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/w3b/v/summary.txt | cut -c1-200
left=$(( ${BUDGET:-585} - SECONDS - 12 ))
if (( left > 120 )); then
  SKIP_BUILD=1 COMMIT=$COMMIT DEADLINE=$left timeout $left bash scripts/gpu_check.sh compare $OUT/w3b/c >$OUT/w3b/c.log 2>&1
  echo "compare rc $? at ${SECONDS}s"; grep -E "auto slower|#wrong" $OUT/w3b/c/summary.txt $OUT/w3b/c.log 2>/dev/null | head -12 | cut -c1-160
fi
tar -czf $OUT/w3b.tgz -C $OUT w3b && rm -rf $OUT/w3b
