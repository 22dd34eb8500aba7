#!/usr/bin/env bash
# Session 22, the compare call (world 2): the same-call comparison (diag/w11/call.sh P=c), then the
# simulated-rank suite of the kernels changed this session, then the FSDP diagnostic (pooled gathers).
#   COMMIT=sha bash diag/w16/callc.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0
P=c BUDGET=${BUDGET_C:-250} BENCH_MAX=256M ROUNDS=3 COMMIT=$COMMIT bash diag/w11/call.sh $OUT; echo "compare done at ${SECONDS}s"
D=$OUT/s; mkdir -p $D
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q tests/gpu_sim/test_sim_ranks.py \
  tests/gpu_sim/test_sim_epochs.py tests/gpu_sim/test_sim_safety.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? $(tail -1 $D/sim.log) at ${SECONDS}s"
timeout 150 torchrun --nproc-per-node=2 diag/w15/fsdp_pooled.py --steps fsdp --json $D/fsdp_pooled.json >$D/fsdp_pooled.log 2>&1
echo "fsdp rc $? at ${SECONDS}s"; grep -E "^#|^ +fsdp" $D/fsdp_pooled.log | tail -14
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $D
