#!/usr/bin/env bash
# Session 36, one H200, call 1: main + the rolled look-ahead loop (36dd40a) built from the carried
# cache: tests/gpu_sim whole (incl. test_fp8_cvt's new checks), the examples and MoE CLI at world 1,
# SASS sizes, then the patched tree against a copy with main's unrolled loop (variants.py unrolled),
# alternated, on two simulated ranks. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s1; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S/gpu.txt
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' >> $S/gpu.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w36/variants.py /tmp/vt unrolled
(cd /tmp/vt/unrolled && python3 setup.py build_ext --inplace >$S/build_unrolled.log 2>&1; echo "unrolled build rc $? at ${SECONDS}s") &
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
timeout 100 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep -c 'Out of bounds values : 0 OK' $S/bench_moe_w1.txt) rows OOB 0, $(grep -c 'Out of bounds' $S/bench_moe_w1.txt) rows"
wait
for tree in . /tmp/vt/unrolled; do
  timeout 60 cuobjdump -sass $tree/symcomm/_native/libsymcomm*.so 2>/dev/null | awk '/Function : /{f = ($0 ~ /ep_combine.*iLi2E/) ? $3 : ""} f && /\/\*[0-9a-f]+\*\// {n[f]++} END {for (k in n) print n[k], k}' | sed "s|^|$tree: |" | tee -a $S/sass_sizes.txt
done
NEW=$PWD
for round in 1 2 3; do
  [ $SECONDS -gt 500 ] && break
  QUANTS=none:none,none:fp8,fp8:none timeout 40 python3 diag/w36/ep_time.py new 1 8 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  (cd /tmp/vt/unrolled && PYTHONPATH=$PWD QUANTS=none:none,none:fp8,fp8:none timeout 40 python3 $NEW/diag/w36/ep_time.py unrolled 1 8 64 512 2048 >>$S/time.txt 2>&1); echo "unrolled $round rc $? at ${SECONDS}s"
done
python3 - $S/time.txt <<'PY'
import re, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+)/\w+ tokens\s+(\d+) dispatch (\S+)\s+combine (\S+?)\s*: dispatch\s+(\S+) pair\s+(\S+) combine\s+(\S+)", line)
    if m:
        tree, tok, dq, cq, d, p, c = m.groups()
        rows[(int(tok), dq, cq)][tree].append((float(d), float(c)))
trees = ["new", "unrolled"]
print("tokens dispatch combine | " + " | ".join(f"{t}: dispatch,combine" for t in trees))
for key in sorted(rows):
    print(f"{key[0]:6d} {key[1]:>8} {key[2]:>7} | " + " | ".join(" ".join(f"{d:.1f},{c:.1f}" for d, c in rows[key].get(t, [])) or "-" for t in trees))
PY
tar -czf $OUT/s1.tgz -C $OUT s1 && rm -rf $S
