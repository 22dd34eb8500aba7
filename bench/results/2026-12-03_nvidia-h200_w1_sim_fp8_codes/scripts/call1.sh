#!/usr/bin/env bash
# Session 35, one H200: main (e7e1520 + fp8.cuh: the EP FP8 codes through sm_89's conversions)
# built from the carried nvcc cache; the whole simulated-rank suite (the exhaustive FP8 checks
# among it), the examples at world 1, the MoE CLI at world 1 with its check, the CPU EP tests;
# then MoE dispatch / dispatch + combine on two simulated ranks, main against diag/w35/base
# (e7e1520, built here alongside the tests), alternated twice. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
git log -1 --format=%H > $S/commit.txt 2>/dev/null; git status --short | grep -v "^?? diag" >> $S/commit.txt
nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s: $(grep -c 'cache hit\|cached' $S/build.log) cache lines"
tail -3 $S/build.log
(cd diag/w35/base && python3 setup.py build_ext --inplace >$S/build_base.log 2>&1; echo "base build rc $? at ${SECONDS}s") &
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
timeout 100 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep 'Out of bounds' $S/bench_moe_w1.txt)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_ep_layout.py tests/test_ep_gloo.py >$S/cpu_ep.txt 2>&1; echo "cpu ep tests rc $? at ${SECONDS}s: $(tail -1 $S/cpu_ep.txt)"
wait; NEW=$PWD
export QUANTS=none:none,none:fp8,fp8:none
for round in 1 2; do
  [ $SECONDS -gt 470 ] && break
  timeout 60 python3 diag/w35/ep_time.py new 1 64 512 2048 >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
  (cd diag/w35/base && PYTHONPATH=$PWD timeout 60 python3 $NEW/diag/w35/ep_time.py base 1 64 512 2048 >>$S/time.txt 2>&1); echo "base $round rc $? at ${SECONDS}s"
done
python3 - $S/time.txt <<'PY'
import re, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"(\w+)/\w+ tokens\s+(\d+) dispatch (\S+)\s+combine (\S+?)\s*: dispatch\s+(\S+) pair\s+(\S+) combine\s+(\S+)", line)
    if m:
        tree, tok, dq, cq, d, p, c = m.groups()
        rows[(int(tok), dq, cq)].append((tree, float(d), float(c)))
print(f"{'tokens':>6} {'dispatch':>8} {'combine':>7} | dispatch base / new | combine base / new")
for key in sorted(rows):
    b = [r for r in rows[key] if r[0] == "base"]; n = [r for r in rows[key] if r[0] == "new"]
    fmt = lambda rs, i: " ".join(f"{r[i]:7.2f}" for r in rs)
    print(f"{key[0]:6d} {key[1]:>8} {key[2]:>7} | {fmt(b,1)} / {fmt(n,1)} | {fmt(b,2)} / {fmt(n,2)}")
PY
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
