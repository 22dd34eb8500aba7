#!/usr/bin/env bash
# One H200: slots_ready without early returns (working tree) against diag/ab/prev (e3d4910): all of gpu_sim, then MoE and push A/Bs.
set -uo pipefail
OUT=$1; TAG=${TAG:-s12}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt; cat diag/ab/prev_commit.txt >> $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim -q -rs -x -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)|Error" $OUT/$TAG/gpu_sim.log | head -5
PREV=$(ls diag/ab/prev/symcomm/_native/libsymcomm*.so); NEW=$(ls symcomm/_native/libsymcomm*.so)
EARLY=0 timeout 120 python3 diag/moe_ab.py prev=$PREV new=$NEW prev2=$PREV new2=$NEW 1 8 64 2>&1 | grep -v "warn\|^/opt" | tee $OUT/$TAG/moe_ab.txt | cut -c1-125; echo "moe ab rc $? at ${SECONDS}s"
EARLY=0 timeout 90 python3 diag/push_ab.py prev=$PREV new=$NEW prev2=$PREV new2=$NEW 2 16 2>&1 | grep -v "warn\|^/opt" | tee $OUT/$TAG/push_ab.txt | cut -c1-125; echo "push ab rc $? at ${SECONDS}s"
