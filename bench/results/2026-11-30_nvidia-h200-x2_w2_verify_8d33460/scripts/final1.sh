#!/usr/bin/env bash
# Session 17, final lease, call 2: verification part 1, then the simulated-rank tests of the
# flag-free FP4 gather and the FP4 path A/B.   COMMIT=sha bash diag/w11/final1.sh $OUT
set -uo pipefail
OUT=$1; SECONDS=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
P=1 BUDGET=420 COMMIT=$COMMIT bash diag/w11/call.sh $OUT
D=$OUT/s; mkdir -p $D
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 60 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_fp4.py \
  tests/gpu_sim/test_sim_flagfree_collectives.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s: $(tail -1 $D/sim.log)"
timeout 80 torchrun --nproc-per-node=2 bench/fp4_gather.py $D/ab --split both --hidden 7168 --min-bytes 16K \
  --max-bytes 32M --factor 4 --iters 10 --replays 10 --fp4-algo fused-flagfree --fp4-algo fused-push >$D/ab.log 2>&1
echo "ab rc $? at ${SECONDS}s"; grep -E "^\| " $D/ab/fp4_gather.md | cut -c1-150 | head -40
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $D
