#!/usr/bin/env bash
# One H200: simulated-rank tests and the MoE decode profile on the working tree.
set -uo pipefail
OUT=$1; TAG=${TAG:-q}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
CUDA_MODULE_LOADING=EAGER timeout 200 python3 diag/moe_profile.py 1 8 64 2>&1 | tee $OUT/$TAG/moe_profile.txt | grep -v "^    \|warn" ; echo "profile rc $? at ${SECONDS}s"
timeout ${SIM_T:-300} env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest ${SIM:-tests/gpu_sim} -q -rs -x -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"
grep -E "^(FAILED|ERROR)|Error" $OUT/$TAG/gpu_sim.log | head -20
