#!/usr/bin/env bash
# Session 38, one H200, call 5: where the decode dispatch's time goes. The final tree (`full`)
# and six copies whose ep_dispatch returns early at one point each (variants38.py; objects
# compiled on the CPU machine, carried gzipped), dispatch alone at 1, 8 and 64 tokens on two
# simulated ranks, trees alternated. Timing only; not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s5; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; sha256sum csrc/ep.cu >> $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
VOBJS=diag/w38/vobjs python3 diag/w38/variants38.py /tmp/v >$S/variants.txt 2>&1
for n in epoch count mid scan number rows; do (cd /tmp/v/$n && python3 setup.py build_ext --inplace >$S/build_$n.log 2>&1; echo "$n build rc $? at ${SECONDS}s: $(grep -o '[0-9] to compile' $S/build_$n.log)") & done; wait
NEW=$PWD
for round in 1 2 3; do
  for t in full epoch count mid scan number rows; do
    [ $SECONDS -gt 250 ] && break 2
    dir=$NEW; [ $t != full ] && dir=/tmp/v/$t
    (cd $dir && QUANTS=none,nvfp4 PYTHONPATH=$dir timeout 30 python3 $NEW/diag/w38/ep_time38.py $t 1 8 64 >>$S/time.txt 2>&1); echo "$t round $round rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s5.tgz -C $OUT s5
done
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) w(\d) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(m.group(4), int(m.group(3)))][m.group(1)].append(float(m.group(5)))
trees = ["epoch", "count", "mid", "scan", "number", "rows", "full"]
print("quant tokens | " + " | ".join(trees) + "   (median of rounds, us; each tree stops after its phase)")
for key in sorted(rows):
    print(f"{key[0]:6s} {key[1]:4d} | " + " | ".join(f"{statistics.median(rows[key][t]):6.2f}" if rows[key].get(t) else "-" for t in trees))
PY
tar -czf $OUT/s5.tgz -C $OUT s5 && rm -rf $S
