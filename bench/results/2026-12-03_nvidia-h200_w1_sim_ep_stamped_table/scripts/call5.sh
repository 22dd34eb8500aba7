#!/usr/bin/env bash
# Session 39, one H200, call 5: call 3's prefill timing again with more rounds and the order
# swapped every round (base = 877d901, final = fb01f45), two simulated ranks. Timing only.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s5; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; sha256sum csrc/ep.cu csrc/peer.cuh >> $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
T=/tmp/t/base; rm -rf $T; mkdir -p $T/build/nvcc-cache
for p in csrc symcomm tests setup.py pyproject.toml README.md; do cp -r $p $T/; done
rm -f $T/symcomm/_native/*.so; cp diag/w39/src/base.cu $T/csrc/ep.cu; cp diag/w39/src/base.cuh $T/csrc/peer.cuh
cp build/nvcc-cache/* $T/build/nvcc-cache/; for o in diag/w39/objs/base/*.gz; do gunzip -c $o > $T/build/nvcc-cache/$(basename $o .gz); done
(cd $T && python3 setup.py build_ext --inplace >$S/build_base.log 2>&1; echo "base build rc $? at ${SECONDS}s")
NEW=$PWD
run() {
  local world=$1 trees=$2; shift 2
  for t in $trees; do
    [ $SECONDS -gt 300 ] && return
    dir=$NEW; [ $t != final ] && dir=/tmp/t/$t
    (cd $dir && WORLD=$world QUANTS=none,nvfp4 REPS=9 PYTHONPATH=$dir timeout 40 python3 $NEW/diag/w39/ep_time.py $t "$@" >>$S/time.txt 2>&1); echo "$t w$world rc $? at ${SECONDS}s"
  done
}
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then run 2 "base final" 512 2048; else run 2 "final base" 512 2048; fi
done
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) w(\d) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(int(m.group(2)), m.group(4), int(m.group(3)))][m.group(1)].append(float(m.group(5)))
print("world quant tokens | base rounds | final rounds | final/base (medians)")
for key in sorted(rows):
    med = {t: statistics.median(v) for t, v in rows[key].items()}
    print(f"w{key[0]} {key[1]:6s} {key[2]:5d} | " + " | ".join(" ".join(f"{x:.2f}" for x in rows[key].get(t, [])) for t in ("base", "final")) + f" | {med['final'] / med['base']:.3f}")
PY
grep -h alarms $S/time.txt | grep -v "alarms \[0, 0" | head -3
tar -czf $OUT/s5.tgz -C $OUT s5 && rm -rf $S
