#!/usr/bin/env bash
# World 2, first call of session 14: build; all of tests/gpu_sim on GPU 0; verify part 1 (tests/gpu,
# the six examples); the dedup A/B (never / always / built-in) at hidden 7168.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/w6a
echo "$COMMIT" > $OUT/w6a/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/w6a/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 170 env CUDA_VISIBLE_DEVICES=0 CUDA_MODULE_LOADING=EAGER SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider >$OUT/w6a/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/w6a/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)" $OUT/w6a/gpu_sim.log | head -5
left=$(( ${BUDGET:-585} - SECONDS - 15 ))
SKIP_BUILD=1 COMMIT=$COMMIT PART=1 TEST_TIMEOUT=170 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/w6a/v >$OUT/w6a/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/w6a/v/summary.txt | cut -c1-200
left=$(( ${BUDGET:-585} - SECONDS - 8 ))
tar -czf $OUT/w6a.tgz -C $OUT w6a && rm -rf $OUT/w6a
