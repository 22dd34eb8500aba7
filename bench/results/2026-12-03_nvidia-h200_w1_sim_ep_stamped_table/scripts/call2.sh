#!/usr/bin/env bash
# Session 39, one H200, call 2: decode-size dispatch on two (and four) simulated ranks, four trees
# alternated: base (877d901), pre (+ the first item's weights loaded in the prologue: the working
# tree), nomid (pre without the kMid barrier: timing only, an upper bound for a counts table that
# needs no barrier), lb512 (pre with the 512-thread launch bound and 512 threads everywhere:
# timing only at 1 and 8 tokens, no spill), stamp (pre with stamped per-block counts tables in
# place of the kMid barrier). Plus tests/gpu_sim/test_sim_ep.py on pre and on stamp.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s2; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; sha256sum csrc/ep.cu >> $S/status.txt; git status --short >> $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build.log | head -1)"
mk() {  # name ep.cu-source
  local T=/tmp/t/$1; rm -rf $T; mkdir -p $T/build/nvcc-cache
  for p in csrc symcomm tests setup.py pyproject.toml README.md; do cp -r $p $T/; done
  rm -f $T/symcomm/_native/*.so; cp $2 $T/csrc/ep.cu; [ -f diag/w39/src/$1.cuh ] && cp diag/w39/src/$1.cuh $T/csrc/peer.cuh
  cp build/nvcc-cache/* $T/build/nvcc-cache/
  for o in diag/w39/objs/$1/*.gz; do [ -f $o ] && gunzip -c $o > $T/build/nvcc-cache/$(basename $o .gz); done
  (cd $T && python3 setup.py build_ext --inplace >$S/build_$1.log 2>&1; echo "$1 build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build_$1.log | head -1)")
}
for v in base nomid lb512 stamp; do mk $v diag/w39/src/$v.cu & done; wait
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep_pre.txt 2>&1; echo "sim_ep pre rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep_pre.txt)"
grep -E "^(FAILED|ERROR)" $S/sim_ep_pre.txt | head -8
(cd /tmp/t/stamp && PYTHONPATH=/tmp/t/stamp timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep_stamp.txt 2>&1; echo "sim_ep stamp rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep_stamp.txt)")
grep -E "^(FAILED|ERROR)" $S/sim_ep_stamp.txt | head -8
tar -czf $OUT/s2.tgz -C $OUT s2
NEW=$PWD
run() {  # world trees tokens...
  local world=$1 trees=$2; shift 2
  for t in $trees; do
    [ $SECONDS -gt 500 ] && return
    dir=$NEW; [ $t != pre ] && dir=/tmp/t/$t
    (cd $dir && MAXB=${MAXB:-32} WORLD=$world QUANTS=none,nvfp4 REPS=9 PYTHONPATH=$dir timeout 40 python3 $NEW/diag/w39/ep_time.py $t "$@" >>$S/time.txt 2>&1); echo "$t w$world rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s2.tgz -C $OUT s2
}
for round in 1 2 3 4; do run 2 "base pre nomid lb512 stamp" 1 8; run 2 "base pre nomid stamp" 64; done
for round in 1 2; do MAXB=16 run 4 "base pre nomid stamp" 1 8; done
for round in 1 2; do run 2 "pre stamp" 512 2048; done
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) w(\d) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(int(m.group(2)), m.group(4), int(m.group(3)))][m.group(1)].append(float(m.group(5)))
trees = ["base", "pre", "nomid", "lb512", "stamp"]
print("world quant tokens | " + " | ".join(trees) + " | medians of rounds: " + " ".join(trees))
for key in sorted(rows):
    med = {t: statistics.median(rows[key][t]) for t in trees if rows[key].get(t)}
    print(f"w{key[0]} {key[1]:6s} {key[2]:5d} | " + " | ".join(" ".join(f"{x:.2f}" for x in rows[key].get(t, [])) or "-" for t in trees)
          + " | " + " ".join(f"{med[t]:.2f}" if t in med else "-" for t in trees))
PY
grep -h alarms $S/time.txt | grep -v "alarms \[0, 0" | head -3
tar -czf $OUT/s2.tgz -C $OUT s2 && rm -rf $S
