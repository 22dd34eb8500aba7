#!/usr/bin/env bash
# Session 17, call 1 (world 2): the flag-free FP4 gather on real GPUs: sim tests, real-rank tests,
# the CLI sweep and the path A/B.   bash diag/w11/dev.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/d; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
nvidia-smi -L > $D/gpus.txt; python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $D/gpus.txt
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_fp4.py -p no:cacheprovider >$D/sim_fp4.log 2>&1
echo "sim_fp4 rc $? at ${SECONDS}s: $(tail -1 $D/sim_fp4.log)"
SYMCOMM_REQUIRE_GPU=1 timeout 180 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -X faulthandler -m pytest tests/gpu/test_fp4_gpu.py -q -rs -p no:cacheprovider >$D/gpu_fp4_r\$RANK.log 2>&1"
echo "gpu_fp4 rc $? at ${SECONDS}s: r0 $(tail -1 $D/gpu_fp4_r0.log) | r1 $(tail -1 $D/gpu_fp4_r1.log)"
timeout 90 symcomm-bench all_gatherv_fp4 -g 2 -b 1K -e 64M -f 8 -n 5 -w 2 -G 10 --algo all >$D/bench_fp4.log 2>&1
echo "bench_fp4 rc $? at ${SECONDS}s"; grep -E "^ +[0-9]+ " $D/bench_fp4.log | awk '{print $1, $6, $9}' | paste -sd' ' | cut -c1-400
timeout 120 torchrun --nproc-per-node=2 bench/fp4_gather.py $D/ab --split both --hidden 7168 --min-bytes 16K \
  --max-bytes 32M --factor 4 --iters 10 --replays 10 --fp4-algo fused-flagfree --fp4-algo fused-push >$D/ab.log 2>&1
echo "ab rc $? at ${SECONDS}s"; grep -E "^\| " $D/ab/fp4_gather.md | cut -c1-200 | head -40
left=$(( 560 - SECONDS ))
if (( left > 60 )); then
  CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout $left python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_collectives.py tests/gpu_sim/test_sim_fp4_dispatch.py -p no:cacheprovider >$D/sim_ff.log 2>&1
  echo "sim_ff rc $? at ${SECONDS}s: $(tail -1 $D/sim_ff.log)"
fi
tar -czf $OUT/d.tgz -C $OUT d
