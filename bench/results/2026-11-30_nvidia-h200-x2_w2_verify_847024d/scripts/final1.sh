#!/usr/bin/env bash
# Session 19, final lease, call 1 (world 2) on cf92e5e: re-tune the world-2 table, install it as
# the shipped one, then the simulated-rank tests, the FP4 path A/B and verification part 1
# (tests/gpu, examples) with that table in place.   bash diag/w13/final1.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/f; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
nvidia-smi -L > $D/gpus.txt
timeout 150 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o $D/nvidia_h200_w2.json >$D/tune.log 2>&1
echo "tune rc $? at ${SECONDS}s"
[[ -f $D/nvidia_h200_w2.json ]] && cp $D/nvidia_h200_w2.json symcomm/tuning/nvidia_h200_w2.json
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_collectives.py \
  tests/gpu_sim/test_sim_flagfree_fp4.py tests/gpu_sim/test_sim_epochs.py tests/gpu_sim/test_sim_safety.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s: $(tail -1 $D/sim.log)"
timeout 80 torchrun --nproc-per-node=2 bench/fp4_gather.py $D/ab --split both --hidden 7168 --min-bytes 1M \
  --max-bytes 16M --factor 2 --iters 10 --replays 10 --fp4-algo fused-flagfree --fp4-algo fused-push >$D/ab.log 2>&1
echo "ab rc $? at ${SECONDS}s"
grep -A2 "^# all" $D/tune.log | head -0; grep "^# " $D/tune.log | tail -8 | cut -c1-400
tar -czf $OUT/f.tgz -C $OUT f
P=1 BUDGET=$(( 590 - SECONDS )) COMMIT="cf92e5e with the table tuned in this call" bash diag/w11/call.sh $OUT
