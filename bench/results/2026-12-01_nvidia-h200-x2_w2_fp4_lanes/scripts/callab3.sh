#!/usr/bin/env bash
# Session 28, the third FP4 A/B (world 2): build; fp4ab.py with forced launches (blocks x threads,
# b = block-major lanes) beside auto; kprof.py (the kernels a graph replays, their durations);
# then fp4ab.py (auto only) in builds that leave out one part of the kernel (variants.py).
#   bash diag/w28/callab3.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export ROUNDS=${ROUNDS:-9}
SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w28/variants.py /tmp/v_ noenc nounpack noown >$OUT/variants_build.txt 2>&1 &
timeout 200 torchrun --nproc-per-node=2 diag/w28/fp4ab.py >$OUT/fp4ab.txt 2>&1; echo "fp4ab rc $? at ${SECONDS}s"
timeout 90 torchrun --nproc-per-node=2 diag/w28/kprof.py >$OUT/kprof.txt 2>&1; echo "kprof rc $? at ${SECONDS}s"
wait; cat $OUT/variants_build.txt
for v in noenc nounpack noown; do
  (cd /tmp/v_$v && FORCED= PYTHONPATH=/tmp/v_$v timeout 90 torchrun --nproc-per-node=2 diag/w28/fp4ab.py 8192 65536 262144 4194304 >$OUT/fp4ab_$v.txt 2>&1); echo "$v rc $? at ${SECONDS}s"
done
F='^[0-9]* \[|^W1|Warning|gc.get_objects|reduce_op|^ *(rank|exitcode|error_file|traceback|time|host) *:'
grep -Ev "$F" $OUT/fp4ab.txt | tail -16
grep -Ev "$F" $OUT/kprof.txt | tail -24
for v in noenc nounpack noown; do echo "== $v"; grep -Ev "$F" $OUT/fp4ab_$v.txt | grep -v "^#" | tail -5; done
