#!/usr/bin/env bash
# Session 26, last call (world 2): tests/gpu under torchrun and the whole simulated-rank suite, on
# the audited tests.   bash diag/w26/last.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=$OUT/l; mkdir -p $D; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 170 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  'python3 -m pytest tests/gpu -q -rs -p no:cacheprovider > '$D'/tests_gpu.rank$LOCAL_RANK.log 2>&1' >/dev/null 2>&1
echo "tests_gpu rc $? at ${SECONDS}s"; for r in 0 1; do grep -E "^(FAILED|ERROR)" $D/tests_gpu.rank$r.log | head -12; tail -n 1 $D/tests_gpu.rank$r.log; done
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q tests/gpu_sim -p no:cacheprovider >$D/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" $D/gpu_sim.log | head -12; tail -n 1 $D/gpu_sim.log
tar -czf $OUT/l.tgz -C $OUT l && rm -rf $D
