#!/usr/bin/env bash
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
echo "$COMMIT" > $S/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 90 symcomm-bench moe -g 1 -b 114688 -e 7340032 --json $S/bench_moe_w1.json >$S/bench_moe_w1.txt 2>&1
echo "bench moe w1 rc $? at ${SECONDS}s"; grep -E "Using algo|Out of bounds" $S/bench_moe_w1.txt
grep -E "^ +[0-9]" $S/bench_moe_w1.txt | awk '{print $1, $6, $9}' | head -40 | tr '\n' ';'
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
