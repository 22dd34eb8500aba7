#!/usr/bin/env bash
# World 2, first call: build; tune the world-2 table with the shipped table's own command and put
# it in symcomm/tuning (the tree then equals the commit that ships it); verify part 1 on that tree.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/a
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/a/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o $OUT/a/nvidia_h200_w2.json >$OUT/a/tune.log 2>&1
rc=$?; echo "tune rc $rc at ${SECONDS}s"; tail -3 $OUT/a/tune.log | cut -c1-200
if (( rc == 0 )); then
  cp $OUT/a/nvidia_h200_w2.json symcomm/tuning/nvidia_h200_w2.json
  python3 -c "
import json; d=json.load(open('symcomm/tuning/nvidia_h200_w2.json'))
for k in ('all_reduce','all_reduce:inplace'): print(k, [(r[0], r[1][:2]) for r in d['rules'][k]])"
fi
left=$(( ${BUDGET:-585} - SECONDS - 12 ))
SKIP_BUILD=1 COMMIT="$COMMIT" PART=1 TEST_TIMEOUT=170 DEADLINE=$left timeout $left bash scripts/gpu_check.sh verify $OUT/a/v >$OUT/a/v.log 2>&1
echo "verify rc $? at ${SECONDS}s"; grep -E "PASS|FAIL|NOT RUN|verify:" $OUT/a/v/summary.txt | cut -c1-200
tar -czf $OUT/a.tgz -C $OUT a && rm -rf $OUT/a
