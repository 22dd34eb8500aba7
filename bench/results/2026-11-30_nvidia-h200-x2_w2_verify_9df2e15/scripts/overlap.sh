#!/usr/bin/env bash
# Session 26: test_sim_overlap.py three times on its own (its first all-reduce race test is the
# first to launch the unwaiting copy kernel), then the whole simulated-rank suite.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=$OUT/o; mkdir -p $D; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
for i in 1 2 3; do
  CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -s tests/gpu_sim/test_sim_overlap.py -p no:cacheprovider >$D/overlap$i.log 2>&1
  echo "overlap $i rc $? $(tail -1 $D/overlap$i.log) at ${SECONDS}s"; grep -E "stale in" $D/overlap$i.log
done
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 200 python3 -m pytest -q tests/gpu_sim -p no:cacheprovider >$D/gpu_sim.log 2>&1
echo "gpu_sim rc $? $(tail -1 $D/gpu_sim.log) at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" $D/gpu_sim.log | head
tar -czf $OUT/o.tgz -C $OUT o && rm -rf $D
