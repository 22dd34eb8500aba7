#!/usr/bin/env bash
# Session 28, the second FP4 A/B (world 2): build; the grid rule and the prefetch (fp4ab.py, grids
# 32/64/128 forced beside auto); then the same kernel without its encoding (noenc.py's copy).
#   bash diag/w28/callab2.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w28/noenc.py /tmp/noenc >$OUT/noenc_build.txt 2>&1 &
timeout 200 torchrun --nproc-per-node=2 diag/w28/fp4ab.py >$OUT/fp4ab.txt 2>&1; echo "fp4ab rc $? at ${SECONDS}s"
wait; echo "noenc build: $(tail -1 $OUT/noenc_build.txt) at ${SECONDS}s"
(cd /tmp/noenc && FORCED= PYTHONPATH=/tmp/noenc timeout 120 torchrun --nproc-per-node=2 diag/w28/fp4ab.py >$OUT/fp4ab_noenc.txt 2>&1); echo "noenc rc $? at ${SECONDS}s"
grep -v "^[0-9]* \[\|^W1\|Warning\|gc.get_objects" $OUT/fp4ab.txt | tail -22
grep -v "^[0-9]* \[\|^W1\|Warning\|gc.get_objects" $OUT/fp4ab_noenc.txt | tail -14
