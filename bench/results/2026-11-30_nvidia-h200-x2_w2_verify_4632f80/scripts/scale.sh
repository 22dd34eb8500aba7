#!/usr/bin/env bash
# Session 16: what MoE dispatch time follows, at world 2: hidden 3584 / 7168 / 14336 at 512 and
# 2048 tokens (bf16 and NVFP4 columns), graph replay, 3 rounds. Installed build as is.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/s
for h in 3584 14336; do
  timeout 40 symcomm-bench moe -g 2 --hidden $h --tokens 512,2048 -n 10 -w 3 -G 10 -R 3 --algo all \
    --json $OUT/s/h$h.json >$OUT/s/h$h.log 2>&1
  echo "hidden $h rc $? at ${SECONDS}s"
done
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s
