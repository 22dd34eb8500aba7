#!/usr/bin/env bash
# Session 34, one H200: the branch with the combine by entry's partials kept in registers (the first
# version's lived in local memory). Builds the branch and its wide twin (diag/w34/wide:
# SYMCOMM_EP_BY_ENTRY_BYTES 1 GiB) at once, the EP simulated-rank tests, resource usage of the
# combine kernels, then by entry against by rank on two simulated ranks, alternated twice.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
(cd diag/w34/wide && python3 setup.py build_ext --inplace >$S/build_wide.log 2>&1; echo "wide build rc $?") &
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
wait; echo "both built at ${SECONDS}s"
cuobjdump -res-usage symcomm/_native/libsymcomm*.so 2>/dev/null | grep -A1 "ep_combine" | grep -E "STACK|Function" | paste - - | sed -E 's/.*(ep_combine[a-z_]*ILi([0-9])E([A-Za-z0-9_]*)).*(REG:[0-9]+ STACK:[0-9]+).*/\1 \4/' | sort | uniq -c | head -30 > $S/res_usage.txt
head -30 $S/res_usage.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep.txt 2>&1; echo "sim ep rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep.txt)"
grep -E "^(FAILED|ERROR)" $S/sim_ep.txt | head -5
NEW=$PWD
for round in 1 2; do
  MODES=builtin,rank timeout 100 python3 diag/w34/ep_time.py new 1 8 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  (cd diag/w34/wide && PYTHONPATH=$PWD MODES=builtin,rank QUANTS=bf16 timeout 80 python3 $NEW/diag/w34/ep_time.py wide 8 16 32 64 512 >>$S/time.txt 2>&1); echo "wide $round rc $? at ${SECONDS}s"
done
grep -E "tokens" $S/time.txt | sed -E 's/ +/ /g' | cut -d' ' -f1,3,5,7,10,12,14 | sort -s -k2,2n -k3,4 | head -80
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
