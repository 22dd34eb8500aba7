#!/usr/bin/env bash
# Session 35, one H200, call 2: main (a68732c + test_fp8_cvt compiling with nvcc, subnormals
# kept) from the carried cache: tests/gpu_sim whole; then MoE timing on two simulated ranks of
# main against diag/w35/base (e7e1520) and two timing-only variants of main's FP8 combine
# (diag/w35/variants.py), alternated twice. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s2; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w35/variants.py /tmp/vt
mkdir -p diag/w35/base/symcomm/_native diag/w35/base/build && cp -r build/nvcc-cache diag/w35/base/build/
for t in diag/w35/base /tmp/vt/noenc /tmp/vt/noamax; do
  (cd $t && python3 setup.py build_ext --inplace >$S/build_$(basename $t).log 2>&1; echo "$t build rc $? at ${SECONDS}s") &
done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_fp8_cvt.py -v 2>&1 | grep -E "PASS|FAIL|SKIP" > $S/fp8_cvt.txt; cat $S/fp8_cvt.txt | tail -16
wait; echo "all built at ${SECONDS}s"
NEW=$PWD
for round in 1 2; do
  [ $SECONDS -gt 500 ] && break
  QUANTS=none:none,none:fp8,fp8:none timeout 45 python3 diag/w35/ep_time.py new 1 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  (cd diag/w35/base && PYTHONPATH=$PWD QUANTS=none:none,none:fp8,fp8:none timeout 45 python3 $NEW/diag/w35/ep_time.py base 1 64 512 2048 >>$S/time.txt 2>&1); echo "base $round rc $? at ${SECONDS}s"
  for v in noenc noamax; do
    (cd /tmp/vt/$v && PYTHONPATH=$PWD QUANTS=none:fp8 timeout 30 python3 $NEW/diag/w35/ep_time.py $v 1 64 512 2048 >>$S/time.txt 2>&1); echo "$v $round rc $? at ${SECONDS}s"
  done
done
python3 - $S/time.txt <<'PY'
import re, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+)/\w+ tokens\s+(\d+) dispatch (\S+)\s+combine (\S+?)\s*: dispatch\s+(\S+) pair\s+(\S+) combine\s+(\S+)", line)
    if m:
        tree, tok, dq, cq, d, p, c = m.groups()
        rows[(int(tok), dq, cq)][tree].append((float(d), float(c)))
trees = ["base", "new", "noenc", "noamax"]
print("tokens dispatch combine | " + " | ".join(f"{t}: dispatch, combine" for t in trees))
for key in sorted(rows):
    cells = []
    for t in trees:
        rs = rows[key].get(t, [])
        cells.append(" ".join(f"{d:.1f},{c:.1f}" for d, c in rs) or "-")
    print(f"{key[0]:6d} {key[1]:>8} {key[2]:>7} | " + " | ".join(cells))
PY
tar -czf $OUT/s2.tgz -C $OUT s2 && rm -rf $S
