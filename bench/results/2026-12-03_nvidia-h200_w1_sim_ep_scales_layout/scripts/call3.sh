#!/usr/bin/env bash
# Session 38, one H200, call 3: call 2 again at four simulated ranks with 16 blocks a rank (32 a
# rank, 128 blocks of 1024 threads, could not all be resident there: every call 2 run at four
# ranks raised the alarm), old / new / layout trees, then one round at two ranks for decode
# sizes. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s3; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
for t in old layout; do mkdir -p diag/w38/$t/build/nvcc-cache diag/w38/$t/symcomm/_native && cp build/nvcc-cache/* diag/w38/$t/build/nvcc-cache/ && for o in diag/w38/objs/$t/*.gz; do gunzip -c $o > diag/w38/$t/build/nvcc-cache/$(basename $o .gz); done; done
for t in old layout; do (cd diag/w38/$t && python3 setup.py build_ext --inplace >$S/build_$t.log 2>&1; echo "$t build rc $? at ${SECONDS}s"); done
NEW=$PWD
run() {  # world, tokens..., into time.txt
  local world=$1; shift
  for t in new old layout; do
    [ $SECONDS -gt 150 ] && return
    dir=$NEW; [ $t != new ] && dir=$NEW/diag/w38/$t
    (cd $dir && MAXB=${MAXB:-32} WORLD=$world QUANTS=none,nvfp4 PYTHONPATH=$dir timeout 40 python3 $NEW/diag/w38/ep_time38.py $t "$@" >>$S/time.txt 2>&1); echo "$t w$world rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s3.tgz -C $OUT s3
}
for round in 1 2; do MAXB=16 run 4 512 2048; done
run 2 1 8 64
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) w(\d) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(int(m.group(2)), m.group(4), int(m.group(3)))][m.group(1)].append(float(m.group(5)))
trees = ["old", "new", "layout"]
print("world quant tokens | " + " | ".join(trees) + " | new/old layout/old (medians of rounds)")
for key in sorted(rows):
    med = {t: statistics.median(rows[key][t]) for t in trees if rows[key].get(t)}
    ratio = " ".join(f"{med[t] / med['old']:.3f}" if t in med and 'old' in med else "-" for t in ("new", "layout"))
    print(f"w{key[0]} {key[1]:6s} {key[2]:5d} | " + " | ".join(" ".join(f"{x:.1f}" for x in rows[key].get(t, [])) or "-" for t in trees) + f" | {ratio}")
PY
tar -czf $OUT/s3.tgz -C $OUT s3 && rm -rf $S
