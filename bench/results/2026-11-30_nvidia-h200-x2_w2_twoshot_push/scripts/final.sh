#!/usr/bin/env bash
# Session 23, last call (world 2): tests/gpu on the final commit after the review's check-mode
# change (no kernel or launch change since 740954b's full verification).
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/f; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SYMCOMM_REQUIRE_GPU=1 timeout 150 torchrun --nproc-per-node=2 --no-python bash -c \
  'python3 -m pytest tests/gpu -q -rs -p no:cacheprovider >'$D'/tests_gpu_r$RANK.log 2>&1'
echo "tests_gpu rc $? at ${SECONDS}s"; for f in $D/tests_gpu_r*.log; do echo "$(basename $f): $(tail -1 $f)"; done
tar -czf $OUT/f.tgz -C $OUT f
