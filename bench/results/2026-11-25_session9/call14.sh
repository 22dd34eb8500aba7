#!/usr/bin/env bash
# Session 9, device call 14 (the second review's fixes: one row_parts rule for both kernels with
# a testing hook, ABI 4): all of tests/gpu_sim; bench/local_kernels.py --skip-quantize once.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD
D=${OUT:-out}; mkdir -p "$D"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; md5sum csrc/* symcomm/_native/*.so; } > "$D/env.txt" 2>&1
SECONDS=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim -rs > "$D/gpu_sim.txt" 2>&1
echo "gpu_sim rc=$? in ${SECONDS}s"; tail -2 "$D/gpu_sim.txt"
SECONDS=0
timeout 120 python3 bench/local_kernels.py --skip-quantize --json "$D/local_kernels.json" > "$D/local_kernels.txt" 2>&1
echo "local_kernels rc=$? in ${SECONDS}s"; sed -n 3,14p "$D/local_kernels.txt"
