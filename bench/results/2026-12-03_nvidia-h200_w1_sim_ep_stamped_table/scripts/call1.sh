#!/usr/bin/env bash
# Session 39, one H200, call 1: (a) tests/gpu_sim/test_sim_ep.py on main df8941e, whose cases from
# 364db87 (repeated experts within tokens, swizzled NVFP4 with 9 scales a row) never ran on a GPU;
# (b) the copy_scales spill patch (session 38's results folder) built as a second tree, its EP sim
# tests, and dispatch-alone timing main vs patch, alternated, two and four simulated ranks.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s1; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; sha256sum csrc/ep.cu diag/w39/spill_ep.cu >> $S/status.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S/gpu.txt
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' >> $S/gpu.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
T=$PWD/diag/w39/spill; rm -rf $T; mkdir -p $T/build/nvcc-cache
for p in csrc symcomm tests setup.py pyproject.toml README.md; do cp -r $p $T/; done
rm -f $T/symcomm/_native/*.so; cp diag/w39/spill_ep.cu $T/csrc/ep.cu; cp build/nvcc-cache/* $T/build/nvcc-cache/
for o in diag/w39/objs/spill/*.gz; do gunzip -c $o > $T/build/nvcc-cache/$(basename $o .gz); done
(cd $T && python3 setup.py build_ext --inplace >$S/build_spill.log 2>&1; echo "spill build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build_spill.log)")
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep_main.txt 2>&1; echo "sim_ep main rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep_main.txt)"
grep -E "^(FAILED|ERROR)" $S/sim_ep_main.txt | head -8
tar -czf $OUT/s1.tgz -C $OUT s1
(cd $T && PYTHONPATH=$T timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ep.py >$S/sim_ep_spill.txt 2>&1; echo "sim_ep spill rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep_spill.txt)")
grep -E "^(FAILED|ERROR)" $S/sim_ep_spill.txt | head -8
tar -czf $OUT/s1.tgz -C $OUT s1
NEW=$PWD
run() {  # world, tokens...
  local world=$1; shift
  for t in main spill; do
    [ $SECONDS -gt 520 ] && return
    dir=$NEW; [ $t != main ] && dir=$T
    (cd $dir && MAXB=${MAXB:-32} WORLD=$world QUANTS=nvfp4,fp8 PYTHONPATH=$dir timeout 60 python3 $NEW/diag/w39/ep_time.py $t "$@" >>$S/time.txt 2>&1); echo "$t w$world rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s1.tgz -C $OUT s1
}
for round in 1 2 3; do run 2 512 2048; MAXB=16 run 4 2048; done
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) w(\d) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(int(m.group(2)), m.group(4), int(m.group(3)))][m.group(1)].append(float(m.group(5)))
trees = ["main", "spill"]
print("world quant tokens | main rounds | spill rounds | spill/main (medians)")
for key in sorted(rows):
    med = {t: statistics.median(rows[key][t]) for t in trees if rows[key].get(t)}
    ratio = f"{med['spill'] / med['main']:.3f}" if len(med) == 2 else "-"
    print(f"w{key[0]} {key[1]:6s} {key[2]:5d} | " + " | ".join(" ".join(f"{x:.1f}" for x in rows[key].get(t, [])) or "-" for t in trees) + f" | {ratio}")
PY
grep -h alarms $S/time.txt | grep -v "alarms \[0, 0" | head -3
tar -czf $OUT/s1.tgz -C $OUT s1 && rm -rf $S
