#!/usr/bin/env bash
# World-2 verification, part 1 and the sweeps of part 2 (gpu_check.sh verify), one tarball back.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0
mkdir -p $OUT/h
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/h/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SKIP_BUILD=1 COMMIT=$COMMIT PART=1 TEST_TIMEOUT=${TT:-210} DEADLINE=${D1:-340} timeout ${D1:-340} bash scripts/gpu_check.sh verify $OUT/h/p1 >$OUT/h/p1.log 2>&1
echo "part1 rc $? at ${SECONDS}s"
REST=$(( ${BUDGET:-575} - SECONDS ))
SKIP_BUILD=1 COMMIT=$COMMIT PART=2 ONLY="${ONLY2:-bench_all_reduce bench_all_gather bench_reduce_scatter bench_all_gatherv bench_reduce_scatterv bench_all_gatherv_fp4 bench_all_reduce_rmsnorm bench_moe}" DEADLINE=$REST timeout $REST bash scripts/gpu_check.sh verify $OUT/h/p2 >$OUT/h/p2.log 2>&1
echo "part2 rc $? at ${SECONDS}s"
for p in p1 p2; do echo "== $p"; cat $OUT/h/$p/summary.txt 2>/dev/null | tail -30; done
tar -czf $OUT/${TAG:-h1}.tgz -C $OUT h && rm -rf $OUT/h
