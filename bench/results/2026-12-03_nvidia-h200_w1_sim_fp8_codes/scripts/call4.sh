#!/usr/bin/env bash
# Session 35, one H200, call 4: main with fp8.cuh's rare division rolled (one division's code),
# built from the carried cache: tests/gpu_sim whole, the examples at world 1, the MoE CLI at
# world 1; SASS sizes of the W=2 bf16 combines; then main against a variant whose combine loop
# over look-ahead groups is rolled (diag/w35/variants.py rolled), alternated twice, on two
# simulated ranks. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s4; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w35/variants.py /tmp/vt rolled
(cd /tmp/vt/rolled && python3 setup.py build_ext --inplace >$S/build_rolled.log 2>&1; echo "rolled build rc $? at ${SECONDS}s") &
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
timeout 100 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep -c 'Out of bounds values : 0 OK' $S/bench_moe_w1.txt) rows OOB 0, $(grep -c 'Out of bounds' $S/bench_moe_w1.txt) rows"
wait
for tree in . /tmp/vt/rolled; do
  timeout 60 cuobjdump -sass $tree/symcomm/_native/libsymcomm*.so 2>/dev/null | awk '/Function : /{f = ($0 ~ /ep_combineILi[02]E13__nv_bfloat16iLi2E/) ? $3 : ""} f && /\/\*[0-9a-f]+\*\// {n[f]++} END {for (k in n) print n[k], k}' | sed "s|^|$tree: |" | tee -a $S/sass_sizes.txt
done
NEW=$PWD
for round in 1 2; do
  [ $SECONDS -gt 520 ] && break
  QUANTS=none:none,none:fp8,fp8:none timeout 40 python3 diag/w35/ep_time.py new 1 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  (cd /tmp/vt/rolled && PYTHONPATH=$PWD QUANTS=none:none,none:fp8 timeout 30 python3 $NEW/diag/w35/ep_time.py rolled 1 64 512 2048 >>$S/time.txt 2>&1); echo "rolled $round rc $? at ${SECONDS}s"
done
python3 - $S/time.txt <<'PY'
import re, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+)/\w+ tokens\s+(\d+) dispatch (\S+)\s+combine (\S+?)\s*: dispatch\s+(\S+) pair\s+(\S+) combine\s+(\S+)", line)
    if m:
        tree, tok, dq, cq, d, p, c = m.groups()
        rows[(int(tok), dq, cq)][tree].append((float(d), float(c)))
trees = ["new", "rolled"]
print("tokens dispatch combine | " + " | ".join(f"{t}: dispatch,combine" for t in trees))
for key in sorted(rows):
    print(f"{key[0]:6d} {key[1]:>8} {key[2]:>7} | " + " | ".join(" ".join(f"{d:.1f},{c:.1f}" for d, c in rows[key].get(t, [])) or "-" for t in trees))
PY
tar -czf $OUT/s4.tgz -C $OUT s4 && rm -rf $S
