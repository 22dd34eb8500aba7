#!/usr/bin/env bash
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PART=1 TEST_TIMEOUT=300 bash scripts/gpu_check.sh verify "$OUT" 2>&1 | tail -25
export PYTHONPATH=$PWD
L=$OUT/diag; mkdir -p $L
trap 'tar -czf $OUT/diag.tgz -C $OUT diag && rm -rf $L' EXIT
for c in 0 1; do
  CHECK=$c timeout 100 torchrun --nproc-per-node=2 diag/twoshot_capture.py > $L/twoshot_check$c.log 2>&1
  echo "twoshot check=$c exit $?"; grep -E "^rank|File \"/work|Error" $L/twoshot_check$c.log | grep -v "site-packages" | head -40
done
timeout 120 symcomm-bench moe -g 2 --tokens 1,512,2048 --algo peer-push+fp8 -n 5 -w 2 -G 5 > $L/moe.log 2>&1; echo "moe fp8 exit $?"; grep -E "Out of" $L/moe.log
timeout 150 torchrun --nproc-per-node=2 bench/layer_step.py --tokens 1,64 --iters 5 --rounds 2 > $L/layer.log 2>&1; echo "layer exit $?"; grep -v "^\[W\|^W1\|frame #" $L/layer.log | tail -45
