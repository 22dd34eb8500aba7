#!/usr/bin/env bash
# Session 19, dev call (world 2): the 4 MiB flag-free slot at world 2. Forced-path sweeps across
# the old and new slot limits, the re-tune (with tune's trend estimate), the FP4 path A/B at the
# sizes the larger slot opens, and the simulated-rank flag-free tests.   bash diag/w13/dev.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/d; mkdir -p $D/sweeps
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
nvidia-smi -L > $D/gpus.txt
c=(-g 2 -n 20 -w 5 -G 10 -R 3)
timeout 70 symcomm-bench all_reduce "${c[@]}" -b 1M -e 8M -f 2 --algo custom-flagfree,custom-oneshot,custom-twoshot >$D/sweeps/ar.log 2>&1; echo -n "ar $? "
timeout 70 symcomm-bench all_gather "${c[@]}" -b 2M -e 16M -f 2 --algo custom-flagfree,custom-push >$D/sweeps/ag.log 2>&1; echo -n "ag $? "
timeout 70 symcomm-bench reduce_scatter "${c[@]}" -b 2M -e 16M -f 2 --algo custom-flagfree,custom-oneshot >$D/sweeps/rs.log 2>&1; echo -n "rs $? "
timeout 70 symcomm-bench all_gatherv "${c[@]}" -b 3M -e 12M -f 2 --algo custom-flagfree,custom-push >$D/sweeps/agv.log 2>&1; echo -n "agv $? "
timeout 70 symcomm-bench reduce_scatterv "${c[@]}" -b 3M -e 12M -f 2 --algo custom-flagfree,custom-oneshot >$D/sweeps/rsv.log 2>&1; echo "rsv $? at ${SECONDS}s"
timeout 150 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o $D/nvidia_h200_w2.json >$D/tune.log 2>&1
echo "tune rc $? at ${SECONDS}s"
timeout 90 torchrun --nproc-per-node=2 bench/fp4_gather.py $D/ab --split both --hidden 7168 --min-bytes 1M \
  --max-bytes 16M --factor 2 --iters 10 --replays 10 --fp4-algo fused-flagfree --fp4-algo fused-push >$D/ab.log 2>&1
echo "ab rc $? at ${SECONDS}s"
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_collectives.py \
  tests/gpu_sim/test_sim_flagfree_fp4.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s: $(tail -1 $D/sim.log)"
for f in $D/sweeps/*.log; do echo "== $f"; grep -E "^ +[0-9]+ " $f | head -12; done
tar -czf $OUT/d.tgz -C $OUT d
