#!/usr/bin/env bash
# Call X2 (2026-11-28 session 5), nvidia-h200-x2, tree = branch flagfree-v: the flag-free kernels
# take every rank's chunk, so custom-flagfree serves all_gatherv / reduce_scatterv. Simulated-rank
# kernel tests (W 2/4/8 on one GPU), the world-2 tests, a fresh world-2 tune (the shipped table's
# v-rows predate the path), and the v-op and even-op sweeps with --algo all under that table.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $((SECONDS-T0)) s"
S=$OUT/x2; mkdir -p "$S"
s() { local n=$1 t=$2; shift 2; local t0=$SECONDS; timeout "$t" "$@" >"$S/$n.log" 2>&1; echo "$n: exit $? in $((SECONDS-t0)) s (at $((SECONDS-T0)))" | tee -a "$S/steps.txt"; }
s sim 150 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_sim/test_sim_flagfree_collectives.py \
  tests/gpu_sim/test_sim_ranks.py tests/gpu_sim/test_sim_safety.py
tail -3 "$S/sim.log"
s gpu_w2 150 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -m pytest tests/gpu/test_flagfree_collectives.py tests/gpu/test_custom_ar.py tests/gpu/test_collectives.py -q -x -p no:cacheprovider >$S/gpu_w2_r\$RANK.log 2>&1"
tail -n 3 "$S"/gpu_w2_r*.log
s tune 120 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o "$S/nvidia_h200_w2.json"
export SYMCOMM_TUNING_FILE=$S/nvidia_h200_w2.json
for op in all_gatherv reduce_scatterv all_gather reduce_scatter; do
  s "bench_$op" 60 symcomm-bench $op -g 2 -b 1K -e 32M -f 8 -n 20 -w 5 -G 10 -R 3 --algo all --json "$S/bench_$op.json"
  grep -A12 "Summary" "$S/bench_$op.log" | cut -c1-60,140-400 | head -12
done
python3 -c "
import json; t = json.load(open('$S/nvidia_h200_w2.json'))
for op in ('all_gatherv', 'reduce_scatterv', 'all_gather', 'reduce_scatter'): print(op, t['rules'].get(op))"
echo "total: $((SECONDS-T0)) s"
tar -czf "$OUT/x2.tgz" -C "$OUT" x2 build.log && rm -rf "$S"
