#!/usr/bin/env bash
# Session 39, one H200, call 6: the final tree (fb01f45 with the table read keeping only values and
# stale bits live, for the spill) — tests/gpu_sim/test_sim_ep.py (the EP kernels bitwise against
# their CPU twin at 2, 4 and 8 simulated ranks, stall and mismatch alarms), the MoE CLI at world 1
# (out-of-bounds check), then dispatch-alone timing against base (877d901), order swapped every
# round, two simulated ranks. Timing only.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s6; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; sha256sum csrc/ep.cu csrc/peer.cuh >> $S/status.txt; git status --short >> $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build.log | head -1)"
T=/tmp/t/base; rm -rf $T; mkdir -p $T/build/nvcc-cache
for p in csrc symcomm tests setup.py pyproject.toml README.md; do cp -r $p $T/; done
rm -f $T/symcomm/_native/*.so; cp diag/w39/src/base.cu $T/csrc/ep.cu; cp diag/w39/src/base.cuh $T/csrc/peer.cuh
cp build/nvcc-cache/* $T/build/nvcc-cache/; for o in diag/w39/objs/base/*.gz; do gunzip -c $o > $T/build/nvcc-cache/$(basename $o .gz); done
(cd $T && python3 setup.py build_ext --inplace >$S/build_base.log 2>&1; echo "base build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build_base.log | head -1)") &
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep.txt 2>&1; echo "sim_ep rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep.txt)"
grep -E "^(FAILED|ERROR)" $S/sim_ep.txt | head -8
wait
timeout 40 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep -c 'Out of bounds values : 0 OK' $S/bench_moe_w1.txt) rows OOB 0 of $(grep -c 'Out of bounds' $S/bench_moe_w1.txt)"
tar -czf $OUT/s6.tgz -C $OUT s6
NEW=$PWD
run() {
  local world=$1 trees=$2; shift 2
  for t in $trees; do
    [ $SECONDS -gt 150 ] && return
    dir=$NEW; [ $t != final ] && dir=/tmp/t/$t
    (cd $dir && WORLD=$world QUANTS=none,nvfp4 REPS=9 PYTHONPATH=$dir timeout 30 python3 $NEW/diag/w39/ep_time.py $t "$@" >>$S/time.txt 2>&1); echo "$t w$world rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s6.tgz -C $OUT s6
}
run 2 "base final" 2048; run 2 "final base" 2048
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then run 2 "base final" 1 8 512; else run 2 "final base" 1 8 512; fi
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
    r = f"{med['final'] / med['base']:.3f}" if len(med) == 2 else "-"
    print(f"w{key[0]} {key[1]:6s} {key[2]:5d} | " + " | ".join(" ".join(f"{x:.2f}" for x in rows[key].get(t, [])) for t in ("base", "final")) + f" | {r}")
PY
grep -h alarms $S/time.txt | grep -v "alarms \[0, 0" | head -3
tar -czf $OUT/s6.tgz -C $OUT s6 && rm -rf $S
