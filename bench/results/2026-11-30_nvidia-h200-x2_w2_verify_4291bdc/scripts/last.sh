#!/usr/bin/env bash
# Session 25, last call: tests/gpu at world 2 under torchrun, then the simulated-rank files whose
# tests changed since the verification.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/l; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/l/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 150 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  'python3 -m pytest tests/gpu -q -rs -p no:cacheprovider > '$OUT'/l/tests_gpu.rank$LOCAL_RANK.log 2>&1' >/dev/null 2>&1
echo "tests_gpu rc $? at ${SECONDS}s"; for r in 0 1; do grep -E "^(FAILED|ERROR)" $OUT/l/tests_gpu.rank$r.log | head -20; tail -n 1 $OUT/l/tests_gpu.rank$r.log; done
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 80 python3 -m pytest -q -rs tests/gpu_sim/test_sim_ep.py \
  tests/gpu_sim/test_sim_flagfree_collectives.py tests/gpu_sim/test_sim_ranks.py -p no:cacheprovider >$OUT/l/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" $OUT/l/sim.log | head; tail -n 1 $OUT/l/sim.log
tar -czf $OUT/l.tgz -C $OUT l && rm -rf $OUT/l
