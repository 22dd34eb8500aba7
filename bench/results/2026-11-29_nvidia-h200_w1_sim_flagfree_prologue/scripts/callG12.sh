#!/usr/bin/env bash
# One H200, the branch head: all of tests/gpu_sim, then the world-1 check.
set -uo pipefail
OUT=$1; TAG=${TAG:-g12}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)" $OUT/$TAG/gpu_sim.log | head -5
unset CUDA_MODULE_LOADING
timeout 150 python3 scripts/world1_check.py >$OUT/$TAG/world1.log 2>&1
echo "world1_check rc $? at ${SECONDS}s: $(tail -1 $OUT/$TAG/world1.log)"
