#!/usr/bin/env bash
# One H200: traced build of the EP kernels (diag/trace), then the sim tests on the tree.
set -uo pipefail
OUT=$1; TAG=${TAG:-t}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt
(cd diag/trace/build && python3 setup.py build_ext --inplace) >$OUT/$TAG/trace_build.log 2>&1; echo "trace build rc $? at ${SECONDS}s"
PYTHONPATH=diag/trace/build timeout 120 python3 diag/trace/read_trace.py 1 8 2>&1 | grep -v "warn\|^/opt" | tee $OUT/$TAG/trace.txt | grep -v "^    "; echo "trace rc $? at ${SECONDS}s"
