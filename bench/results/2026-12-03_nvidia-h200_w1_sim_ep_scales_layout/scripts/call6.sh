#!/usr/bin/env bash
# Session 38, one H200, call 6: the EP simulated-rank tests with the review's added cases
# (experts repeated within tokens; swizzled NVFP4 rows of nine scales) on the landed kernel.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s6; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; git status --short | grep -v "^?? diag" >> $S/status.txt; sha256sum csrc/ep.cu tests/gpu_sim/test_sim_ep.py >> $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep.txt 2>&1; echo "sim ep rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep.txt)"
grep -E "^(FAILED|ERROR)|Error" $S/sim_ep.txt | head -8
tar -czf $OUT/s6.tgz -C $OUT s6 && rm -rf $S
