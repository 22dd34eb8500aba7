#!/usr/bin/env bash
# One H200: gpu_sim on a real GPU (kernels at simulated W 2/4/8), then gpu_check.sh single.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/s
SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/s/build.log 2>&1; echo "build rc $? at ${SECONDS}s ($(ls symcomm/_native))"
timeout 300 env SYMCOMM_REQUIRE_GPU=1 python3 -X faulthandler -m pytest tests/gpu_sim -q -rs -p no:cacheprovider --durations=15 >$OUT/s/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/s/gpu_sim.log | tail -1)"
REST=$(( ${BUDGET:-560} - SECONDS ))
SKIP_BUILD=1 DEADLINE=$REST TEST_TIMEOUT=$(( REST - 200 )) timeout $REST bash scripts/gpu_check.sh single $OUT/s >$OUT/s/single.log 2>&1
echo "single rc $? at ${SECONDS}s"; cat $OUT/s/summary.txt
tar -czf $OUT/s1.tgz -C $OUT s && rm -rf $OUT/s
