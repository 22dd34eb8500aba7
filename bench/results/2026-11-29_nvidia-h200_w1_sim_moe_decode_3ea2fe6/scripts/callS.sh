#!/usr/bin/env bash
# One H200: the EP simulated-rank tests on the working tree.
set -uo pipefail
OUT=$1; TAG=${TAG:-s}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 150 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim/test_sim_ep.py tests/gpu_sim/test_sim_fp4_dispatch.py -q -rs -p no:cacheprovider >$OUT/$TAG/gpu_sim_ep.log 2>&1
echo "gpu_sim ep rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim_ep.log | tail -1)"
grep -E "^(FAILED|ERROR)" $OUT/$TAG/gpu_sim_ep.log | head
