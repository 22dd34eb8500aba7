#!/usr/bin/env bash
# Session 28 (copied from session 26), one GPU: the README's benchmark command as a one-GPU user types it (it falls back to
# gloo for -g 2 on one GPU), then -g 1 on the GPU, world1_check and quickstart. Not the test command.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/s; SECONDS=0
echo "$COMMIT" > $OUT/s/commit.txt; nvidia-smi -L > $OUT/s/gpus.txt 2>&1; command -v python python3 >> $OUT/s/gpus.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/s/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 60 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$OUT/s/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -c '^ *[0-9]' $OUT/s/readme_bench.txt) rows"; grep -E "Native|device|Buffers" $OUT/s/readme_bench.txt | head -4
timeout 60 symcomm-bench all_reduce -g 1 -b 1K -e 1M --algo all >$OUT/s/readme_bench_g1.txt 2>&1; echo "bench g1 rc $? at ${SECONDS}s"
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$OUT/s/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $OUT/s/world1.txt)"
timeout 40 torchrun --nproc-per-node=1 examples/quickstart.py >$OUT/s/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s
