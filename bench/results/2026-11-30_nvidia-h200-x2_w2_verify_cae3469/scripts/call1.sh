#!/usr/bin/env bash
# Session 27, the first verification call (world 2): part 1 (tests/gpu under torchrun, the
# examples), then the whole simulated-rank suite on one GPU, in one call to save a start.
#   COMMIT=sha bash diag/w27/call1.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0
P=1 BUDGET=560 COMMIT=$COMMIT bash diag/w11/call.sh $OUT; echo "part 1 done at ${SECONDS}s"
D=$OUT/s; mkdir -p $D
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 200 python3 -m pytest -q tests/gpu_sim -p no:cacheprovider >$D/gpu_sim.log 2>&1
echo "gpu_sim rc $? $(tail -1 $D/gpu_sim.log) at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" $D/gpu_sim.log | head
