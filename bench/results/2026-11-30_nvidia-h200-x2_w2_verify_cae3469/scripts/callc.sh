#!/usr/bin/env bash
# Session 27, the compare call (world 2): the same-call comparison (diag/w11/call.sh P=c), then,
# if device time is left, where a 1 KiB flag-free all_gather spends the time it takes beyond
# the all_reduce (kernel durations against replay time).   COMMIT=sha bash diag/w27/callc.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0
P=c BUDGET=${BUDGET_C:-250} BENCH_MAX=${BENCH_MAX:-256M} ROUNDS=3 COMMIT=$COMMIT bash diag/w11/call.sh $OUT; echo "compare done at ${SECONDS}s"
timeout 45 torchrun --nproc-per-node=2 diag/w27/kdur.py >$OUT/kdur.txt 2>&1; echo "kdur rc $?"; grep -A12 "^op " $OUT/kdur.txt
