#!/usr/bin/env bash
# Session 9, device call 4: bench/local_kernels.py with two variants (ca: the weight staged through
# L1 with cp.async.ca; qp3: quantized outputs split rows while rows x parts <= 3 x SMs), and the
# SASS opcode histogram of the decode norm kernels.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD
D=${OUT:-out}; mkdir -p "$D"; S=bench/results/2026-11-25_session9; V=build/variants
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  md5sum csrc/* symcomm/_native/*.so $V/*.so; } > "$D/env.txt" 2>&1
python3 $S/sass_hist.py symcomm/_native/libsymcomm*.so "$D" > "$D/sass_hist.txt" 2>&1; echo "sass rc=$?"; head -60 "$D/sass_hist.txt"
SECONDS=0
timeout 330 python3 bench/local_kernels.py --lib ca=$V/libsymcomm_ca.so --lib qp3=$V/libsymcomm_qp3.so \
  --json "$D/local_kernels.json" > "$D/local_kernels.txt" 2>&1
echo "local_kernels rc=$? in ${SECONDS}s"; cat "$D/local_kernels.txt"
