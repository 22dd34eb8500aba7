#!/usr/bin/env bash
# Session 35, one H200, call 5 (final, on 7b761dd): main with the combine loop over look-ahead
# groups rolled, built from the carried cache: tests/gpu_sim whole (the EP kernels bitwise against
# their CPU twin at W = 2, 4, 8), one timing round on two simulated ranks (not NVLink timing),
# then the examples and the MoE CLI at world 1 while device time lasts. Writes straight into $OUT
# so a cut call still returns its files.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s5; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
QUANTS=none:none,none:fp8,fp8:none timeout 25 python3 diag/w35/ep_time.py new 1 64 512 2048 >>$S/time.txt 2>&1; echo "time rc $? at ${SECONDS}s"
grep tokens $S/time.txt | sed -E 's/ +/ /g' | cut -d' ' -f1-16
timeout 70 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 20 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep -c 'Out of bounds values : 0 OK' $S/bench_moe_w1.txt) rows OOB 0, $(grep -c 'Out of bounds' $S/bench_moe_w1.txt) rows"
