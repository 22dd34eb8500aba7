#!/usr/bin/env bash
# One H200: the dedup dispatch on simulated ranks: EP sim tests, all gpu_sim, then A/B dedup never vs always vs built-in.
set -uo pipefail
OUT=$1; TAG=${TAG:-d1}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout ${SIM_T:-150} env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest ${SIM:-tests/gpu_sim/test_sim_ep.py tests/gpu_sim/test_sim_fp4_dispatch.py} -q -rs -x -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)|Error|assert" $OUT/$TAG/gpu_sim.log | head -8
NEW=$(ls symcomm/_native/libsymcomm*.so)
if [ -z "${NOAB:-}" ]; then
EARLY=0 timeout ${AB_T:-200} python3 diag/moe_ab.py never=$NEW@1099511627776 always=$NEW@0 ${TOKENS:-1 8 64 512 2048} 2>&1 | grep -v "warn\|^/opt" | tee $OUT/$TAG/ab_early0.txt | cut -c1-110; echo "ab rc $? at ${SECONDS}s"
fi
