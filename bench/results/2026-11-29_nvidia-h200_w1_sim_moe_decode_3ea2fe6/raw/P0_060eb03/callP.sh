#!/usr/bin/env bash
# One H200: where MoE decode time goes, simulated ranks (diag/moe_profile.py).
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/p; SECONDS=0
git log -1 --format=%H > $OUT/p/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/p/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $OUT/p/gpu.txt
timeout 300 python3 diag/moe_profile.py 1 8 64 2>&1 | tee $OUT/p/moe_profile.txt | grep -v "^    " ; echo "profile rc $? at ${SECONDS}s"
cp diag/moe_profile.py diag/callP.sh $OUT/p/
