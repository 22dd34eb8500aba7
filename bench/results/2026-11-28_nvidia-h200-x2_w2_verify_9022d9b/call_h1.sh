#!/usr/bin/env bash
# Final call H1 (2026-11-28 session 5), nvidia-h200-x2, world 2 on the final commit: the
# flag-free simulated-rank tests (and the new run-ahead test against cc49a56's library, where it
# must fail), tests/gpu, the six examples, then the collective, norm and MoE sweeps (--algo all).
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?} TEST_TIMEOUT=200
mkdir -p "$OUT/h1" /tmp/v; F=$OUT/h1
xz -dc diag/v/cc49a56.so.xz > /tmp/v/old.so
NEW=tests/gpu_sim/test_sim_flagfree_collectives.py::test_a_rank_with_nothing_to_send_does_not_run_ahead
timeout 40 env SYMCOMM_REQUIRE_GPU=1 SYMCOMM_NATIVE_LIBRARY=/tmp/v/old.so python3 -m pytest -q -p no:cacheprovider "$NEW" >"$F/sim_old_lib.log" 2>&1
echo "run-ahead test on cc49a56's library (must fail): exit $? at $((SECONDS-T0)) s"; tail -2 "$F/sim_old_lib.log"
timeout 90 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_flagfree_collectives.py >"$F/sim.log" 2>&1
echo "sim: exit $? at $((SECONDS-T0)) s"; tail -1 "$F/sim.log"
DEADLINE=400 PART=1 bash scripts/gpu_check.sh verify "$F/v1" >"$F/verify1_screen.txt" 2>&1
echo "verify part 1: done at $((SECONDS-T0)) s"; tail -10 "$F/verify1_screen.txt"
DEADLINE=$((575 - (SECONDS-T0))) PART=2 ONLY="bench_all_reduce bench_all_gather bench_reduce_scatter bench_all_gatherv bench_reduce_scatterv bench_all_gatherv_fp4 bench_all_reduce_rmsnorm bench_moe" \
  bash scripts/gpu_check.sh verify "$F/v2" >"$F/verify2_screen.txt" 2>&1
echo "verify part 2 (sweeps): done at $((SECONDS-T0)) s"; tail -12 "$F/verify2_screen.txt"
tar -czf "$OUT/h1.tgz" -C "$OUT" h1 build.log && rm -rf "$F"
