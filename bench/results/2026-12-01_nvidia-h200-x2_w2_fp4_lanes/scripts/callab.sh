#!/usr/bin/env bash
# Session 28, the FP4 lanes A/B (world 2): build, then diag/w28/fp4ab.py.   bash diag/w28/callab.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout ${AB_LIMIT:-240} torchrun --nproc-per-node=2 diag/w28/fp4ab.py >$OUT/fp4ab.txt 2>&1; echo "fp4ab rc $? at ${SECONDS}s"
grep -v "^[0-9]* \[" $OUT/fp4ab.txt | tail -40
