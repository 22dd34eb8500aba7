#!/usr/bin/env bash
# Session 35, one H200, call 3: what the FP8 combine's encoding is made of. Main (a970326) and
# three timing-only variants (diag/w35/variants.py nocheck nobreak both), FP8 combine on two
# simulated ranks, alternated twice. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s3; mkdir -p $S; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w35/variants.py /tmp/vt nocheck nobreak both
for v in nocheck nobreak both; do
  (cd /tmp/vt/$v && python3 setup.py build_ext --inplace >$S/build_$v.log 2>&1; echo "$v build rc $? at ${SECONDS}s") &
done
cuobjdump -res-usage symcomm/_native/libsymcomm*.so 2>/dev/null | grep -A1 "ep_combineILi2E13__nv_bfloat16iLi2E" | tail -1 > $S/res_new.txt
timeout 90 cuobjdump -sass symcomm/_native/libsymcomm*.so 2>/dev/null | awk '/Function : /{p = ($0 ~ /ep_combineILi2E13__nv_bfloat16iLi2E/)} p' > $S/sass_combine_fp8_w2.txt
echo "sass lines $(wc -l < $S/sass_combine_fp8_w2.txt)"
wait; echo "all built at ${SECONDS}s"
NEW=$PWD
for round in 1 2; do
  QUANTS=none:none,none:fp8 timeout 45 python3 diag/w35/ep_time.py new 1 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  for v in nocheck nobreak both; do
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
        rows[(int(tok), dq, cq)][tree].append(float(c))
trees = ["new", "nocheck", "nobreak", "both"]
print("tokens dispatch combine | combine: " + " | ".join(trees))
for key in sorted(rows):
    print(f"{key[0]:6d} {key[1]:>8} {key[2]:>7} | " + " | ".join(" ".join(f"{c:.1f}" for c in rows[key].get(t, [])) or "-" for t in trees))
PY
tar -czf $OUT/s3.tgz -C $OUT s3 && rm -rf $S
