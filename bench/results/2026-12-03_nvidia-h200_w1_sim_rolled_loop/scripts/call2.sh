#!/usr/bin/env bash
# Session 36, one H200, call 2: the final tree (a4ac741 + docs; ep.cu differs from call 1's only
# in a comment) built from the carried cache: tests/gpu_sim whole; then what the FP8 combine's
# remaining time over bf16 is made of with the loop rolled: timing-only variants noenc, nocheck,
# nobreak (variants.py) against the tree, alternated twice, on two simulated ranks. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s2; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w36/variants.py /tmp/vt noenc nocheck nobreak
for v in noenc nocheck nobreak; do
  (cd /tmp/vt/$v && python3 setup.py build_ext --inplace >$S/build_$v.log 2>&1; echo "$v build rc $? at ${SECONDS}s") &
done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
wait
NEW=$PWD
for round in 1 2; do
  [ $SECONDS -gt 480 ] && break
  QUANTS=none:none,none:fp8 timeout 30 python3 diag/w36/ep_time.py new 1 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  for v in noenc nocheck nobreak; do
    (cd /tmp/vt/$v && PYTHONPATH=$PWD QUANTS=none:fp8 timeout 30 python3 $NEW/diag/w36/ep_time.py $v 1 64 512 2048 >>$S/time.txt 2>&1); echo "$v $round rc $? at ${SECONDS}s"
  done
done
python3 - $S/time.txt <<'PY'
import re, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+)/\w+ tokens\s+(\d+) dispatch (\S+)\s+combine (\S+?)\s*: dispatch\s+(\S+) pair\s+(\S+) combine\s+(\S+)", line)
    if m:
        tree, tok, dq, cq, d, p, c = m.groups()
        rows[(int(tok), dq, cq)][tree].append(float(c))
trees = ["new", "noenc", "nocheck", "nobreak"]
print("tokens dispatch combine | " + " | ".join(trees) + "   (combine µs, per round)")
for key in sorted(rows):
    print(f"{key[0]:6d} {key[1]:>8} {key[2]:>7} | " + " | ".join(" ".join(f"{c:.1f}" for c in rows[key].get(t, [])) or "-" for t in trees))
PY
tar -czf $OUT/s2.tgz -C $OUT s2 && rm -rf $S
