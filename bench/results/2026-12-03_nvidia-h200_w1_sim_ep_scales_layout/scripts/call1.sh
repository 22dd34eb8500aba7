#!/usr/bin/env bash
# Session 38, one H200, call 1: expand_duplicates' scale copy in words (the working tree, `new`)
# against main's (diag/w38/old) and against new + session 30's layout patch (diag/w38/layout):
# the EP simulated-rank tests on new and layout, then dispatch alone on two simulated ranks,
# the three trees alternated. Not NVLink timing.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s1; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S/gpu.txt
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' >> $S/gpu.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
for t in old layout; do mkdir -p diag/w38/$t/build/nvcc-cache diag/w38/$t/symcomm/_native && cp build/nvcc-cache/* diag/w38/$t/build/nvcc-cache/ && for o in diag/w38/objs/$t/*.gz; do gunzip -c $o > diag/w38/$t/build/nvcc-cache/$(basename $o .gz); done; done
(for t in old layout; do (cd diag/w38/$t && python3 setup.py build_ext --inplace >$S/build_$t.log 2>&1; echo "$t build rc $? at ${SECONDS}s"); done) &
EP="tests/gpu_sim/test_sim_ep.py tests/gpu_sim/test_sim_fp4_dispatch.py"
timeout 200 python3 -m pytest -q -p no:cacheprovider $EP >$S/sim_ep_new.txt 2>&1; echo "sim ep new rc $? at ${SECONDS}s: $(tail -1 $S/sim_ep_new.txt)"
grep -E "^(FAILED|ERROR)" $S/sim_ep_new.txt | head -8
wait
(cd diag/w38/layout && PYTHONPATH=$PWD python3 -c 'import symcomm; print(symcomm.__file__)' && PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider $EP) >$S/sim_ep_layout.txt 2>&1; echo "sim ep layout rc $? at ${SECONDS}s: $(head -1 $S/sim_ep_layout.txt) $(tail -1 $S/sim_ep_layout.txt)"
grep -E "^(FAILED|ERROR)" $S/sim_ep_layout.txt | head -8
tar -czf $OUT/s1.tgz -C $OUT s1
NEW=$PWD
for round in 1 2 3; do
  for t in new old layout; do
    [ $SECONDS -gt 520 ] && break 2
    dir=$NEW; [ $t != new ] && dir=$NEW/diag/w38/$t
    (cd $dir && PYTHONPATH=$dir timeout 70 python3 $NEW/diag/w38/ep_time38.py $t 1 64 256 512 2048 >>$S/time.txt 2>&1); echo "$t round $round rc $? at ${SECONDS}s"
  done
  tar -czf $OUT/s1.tgz -C $OUT s1
done
python3 - $S/time.txt <<'PY' | tee $S/summary.txt
import re, sys, collections, statistics
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) tokens\s+(\d+) dispatch (\S+)\s*:\s+(\S+)", line)
    if m:
        rows[(m.group(3), int(m.group(2)))][m.group(1)].append(float(m.group(4)))
trees = ["old", "new", "layout"]
print("quant tokens | " + " | ".join(trees) + " | new/old layout/old (medians of rounds)")
for key in sorted(rows):
    med = {t: statistics.median(rows[key][t]) for t in trees if rows[key].get(t)}
    ratio = " ".join(f"{med[t] / med['old']:.3f}" if t in med and 'old' in med else "-" for t in ("new", "layout"))
    print(f"{key[0]:6s} {key[1]:5d} | " + " | ".join(" ".join(f"{x:.1f}" for x in rows[key].get(t, [])) or "-" for t in trees) + f" | {ratio}")
PY
tar -czf $OUT/s1.tgz -C $OUT s1 && rm -rf $S
