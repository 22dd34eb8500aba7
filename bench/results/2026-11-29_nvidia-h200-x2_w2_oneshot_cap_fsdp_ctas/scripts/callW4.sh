#!/usr/bin/env bash
# Measurement only (no repository change): the custom all-reduce kernels past the 16 MiB staging
# cap, against NCCL and PyTorch's two-shot in one run; FSDP's train step with NCCL at 16 and 64
# CTAs, and which path each of its collectives took.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD; SECONDS=0; mkdir -p $OUT/w4
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/w4/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 torchrun --nproc-per-node=2 diag/w4/bigcap.py all_reduce -b 4M -e 256M -f 4 -n 20 -w 5 -G 20 -R 3 \
  --algo nccl,custom-oneshot,custom-twoshot,symm_mem-twoshot,auto >$OUT/w4/bigcap.log 2>&1
echo "bigcap rc $? at ${SECONDS}s"; grep -E "Using algo|^ +[0-9]+ " $OUT/w4/bigcap.log | cut -c1-110
for ctas in 16 64; do
  timeout 150 torchrun --nproc-per-node=2 diag/w4/paths_of.py bench/train_step.py --steps fsdp --tokens 64,512 \
    --iters 10 --rounds 3 --nccl-max-ctas $ctas >$OUT/w4/fsdp_ctas$ctas.log 2>&1
  echo "fsdp ctas $ctas rc $? at ${SECONDS}s"; grep -E "^  fsdp|^PATH" $OUT/w4/fsdp_ctas$ctas.log
done
tar -czf $OUT/w4.tgz -C $OUT w4 && rm -rf $OUT/w4
