#!/usr/bin/env bash
# Session 39, one H200, call 3: the final tree (877d901 + stamped per-block counts tables in place of
# the dispatch's kMid barrier) as the one-GPU verification: tests/gpu_sim whole, the examples at
# world 1, the MoE CLI at world 1 (every row's out-of-bounds check); then dispatch-alone timing,
# final against base (877d901), alternated, two simulated ranks at decode and prefill sizes, four
# at decode. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s3; mkdir -p $S; SECONDS=0
git log --oneline -1 > $S/status.txt; sha256sum csrc/ep.cu csrc/peer.cuh >> $S/status.txt; git status --short >> $S/status.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S/gpu.txt
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' >> $S/gpu.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build.log | head -1)"
T=/tmp/t/base; rm -rf $T; mkdir -p $T/build/nvcc-cache
for p in csrc symcomm tests setup.py pyproject.toml README.md; do cp -r $p $T/; done
rm -f $T/symcomm/_native/*.so; cp diag/w39/src/base.cu $T/csrc/ep.cu; cp diag/w39/src/base.cuh $T/csrc/peer.cuh
cp build/nvcc-cache/* $T/build/nvcc-cache/; for o in diag/w39/objs/base/*.gz; do gunzip -c $o > $T/build/nvcc-cache/$(basename $o .gz); done
(cd $T && python3 setup.py build_ext --inplace >$S/build_base.log 2>&1; echo "base build rc $? at ${SECONDS}s: $(grep -o '[0-9]* to compile' $S/build_base.log | head -1)")
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
tar -czf $OUT/s3.tgz -C $OUT s3
timeout 120 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep -c 'Out of bounds values : 0 OK' $S/bench_moe_w1.txt) rows OOB 0 of $(grep -c 'Out of bounds' $S/bench_moe_w1.txt)"
tar -czf $OUT/s3.tgz -C $OUT s3
NEW=$PWD
run() {  # world trees tokens...
  local world=$1 trees=$2; shift 2
  for t in $trees; do
    [ $SECONDS -gt 470 ] && return
    dir=$NEW; [ $t != final ] && dir=/tmp/t/$t
    (cd $dir && MAXB=${MAXB:-32} WORLD=$world QUANTS=none,nvfp4 REPS=9 PYTHONPATH=$dir timeout 40 python3 $NEW/diag/w39/ep_time.py $t "$@" >>$S/time.txt 2>&1); echo "$t w$world rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s3.tgz -C $OUT s3
}
run 2 "base final" 512 2048
for round in 1 2 3; do run 2 "base final" 1 8 64; done
for round in 1 2; do MAXB=16 run 4 "base final" 1 8; done
run 2 "final base" 512 2048
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) w(\d) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(int(m.group(2)), m.group(4), int(m.group(3)))][m.group(1)].append(float(m.group(5)))
trees = ["base", "final"]
print("world quant tokens | base rounds | final rounds | final/base (medians)")
for key in sorted(rows):
    med = {t: statistics.median(rows[key][t]) for t in trees if rows[key].get(t)}
    ratio = f"{med['final'] / med['base']:.3f}" if len(med) == 2 else "-"
    print(f"w{key[0]} {key[1]:6s} {key[2]:5d} | " + " | ".join(" ".join(f"{x:.2f}" for x in rows[key].get(t, [])) or "-" for t in trees) + f" | {ratio}")
PY
grep -h alarms $S/time.txt | grep -v "alarms \[0, 0" | head -3
tar -czf $OUT/s3.tgz -C $OUT s3 && rm -rf $S
