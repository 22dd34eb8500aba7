#!/usr/bin/env bash
# Session 17, after review (world 2): tests/gpu under torchrun, the flag-free simulated ranks, the FP4 sweep.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/last2; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SYMCOMM_REQUIRE_GPU=1 timeout 130 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -X faulthandler -m pytest tests/gpu -q -rs -p no:cacheprovider >$D/tests_gpu_r\$RANK.log 2>&1"
echo "tests_gpu rc $? at ${SECONDS}s: r0 $(tail -1 $D/tests_gpu_r0.log) | r1 $(tail -1 $D/tests_gpu_r1.log)"
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 40 python3 -m pytest -q -rs tests/gpu_sim/test_sim_flagfree_fp4.py \
  tests/gpu_sim/test_sim_flagfree_collectives.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s: $(tail -1 $D/sim.log)"
timeout 30 symcomm-bench all_gatherv_fp4 -g 2 -b 1K -e 64M -f 8 -n 5 -w 2 -G 10 --algo all >$D/bench_all_gatherv_fp4.log 2>&1
echo "bench_fp4 rc $? at ${SECONDS}s"; grep -E "^ +[0-9]+ " $D/bench_all_gatherv_fp4.log | awk '{print $1, $6, $9}' | paste -sd' '
tar -czf $OUT/last2.tgz -C $OUT last2
