#!/usr/bin/env bash
# Session 9, device call 8 (commit 01f7331, the final kernels): bench/local_kernels.py three times,
# to see how far the norm's ratio to torch.compile moves between processes (256 tokens went
# 0.84-1.02 over calls 5-7 with the same kernel code at that size).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
D=${OUT:-out}; mkdir -p "$D"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  md5sum csrc/* symcomm/_native/*.so; } > "$D/env.txt" 2>&1
for k in 1 2 3; do
  SECONDS=0
  timeout 150 python3 bench/local_kernels.py --skip-quantize --json "$D/local_kernels_$k.json" > "$D/local_kernels_$k.txt" 2>&1
  echo "run $k rc=$? in ${SECONDS}s"; sed -n 3,14p "$D/local_kernels_$k.txt"
done
