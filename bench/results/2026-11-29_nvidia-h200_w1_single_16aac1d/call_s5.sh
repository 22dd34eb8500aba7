#!/usr/bin/env bash
# One H200: the final commit at world 1, simulated ranks, quickstart, README bench.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/s; SECONDS=0
echo "16aac1d" > $OUT/s/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/s/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 150 torchrun --nproc-per-node=1 scripts/world1_check.py >$OUT/s/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $OUT/s/world1.txt)"
grep -E "^FAIL|nested|rmsnorm" $OUT/s/world1.txt | head
timeout 150 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider >$OUT/s/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/s/gpu_sim.log | tail -1)"
timeout 60 torchrun --nproc-per-node=1 examples/quickstart.py >$OUT/s/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
timeout 60 symcomm-bench all_reduce -g 1 -b 1K -e 1M --algo all >$OUT/s/readme_bench_g1.txt 2>&1; echo "bench g1 rc $? at ${SECONDS}s"
tar -czf $OUT/s5.tgz -C $OUT s && rm -rf $OUT/s
