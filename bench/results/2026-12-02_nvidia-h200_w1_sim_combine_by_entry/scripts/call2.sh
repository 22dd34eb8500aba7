#!/usr/bin/env bash
# Session 34, one H200, two simulated ranks, graph replay: main (diag/w34/old, 6d19920), the branch
# by entry (its built-in choice) and by rank (threshold 0), and a wide build of the branch
# (diag/w34/wide: SYMCOMM_EP_BY_ENTRY_BYTES 1 GiB, so every size can go by entry) from 16 to 512
# tokens, alternated twice. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
NEW=$PWD
for round in 1 2; do
  (cd diag/w34/old && PYTHONPATH=$PWD timeout 80 python3 $NEW/diag/w34/ep_time.py old 1 8 64 512 2048 >>$S/time.txt 2>&1); echo "old $round rc $? at ${SECONDS}s"
  MODES=builtin,rank timeout 120 python3 diag/w34/ep_time.py new 1 8 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  (cd diag/w34/wide && PYTHONPATH=$PWD MODES=builtin,rank QUANTS=bf16 timeout 80 python3 $NEW/diag/w34/ep_time.py wide 16 32 64 512 >>$S/time.txt 2>&1); echo "wide $round rc $? at ${SECONDS}s"
done
grep -E "tokens" $S/time.txt | awk '{print $1,$3,$5,$7,$9,$11,$13,$15}'
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
