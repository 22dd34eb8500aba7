#!/usr/bin/env bash
# Session 9, device call 5 (the code as committed, weight staged through L1): all of tests/gpu_sim;
# bench/local_kernels.py against the build before this session (main) and a variant rounding y
# two values per conversion (pk), then once more alone; bench/fused_norm_sim.py against main.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD:$PWD/tests/gpu_sim
D=${OUT:-out}; mkdir -p "$D"; V=build/variants
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  nvcc --version | tail -2; md5sum csrc/* symcomm/_native/*.so $V/*.so; } > "$D/env.txt" 2>&1
SECONDS=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim -rs > "$D/gpu_sim.txt" 2>&1
echo "gpu_sim rc=$? in ${SECONDS}s"; tail -2 "$D/gpu_sim.txt"
SECONDS=0
timeout 200 python3 bench/local_kernels.py --lib main=$V/libsymcomm_main.so --lib pk=$V/libsymcomm_pk.so \
  --json "$D/local_kernels.json" > "$D/local_kernels.txt" 2>&1
echo "local_kernels rc=$? in ${SECONDS}s"; cat "$D/local_kernels.txt"
SECONDS=0
timeout 120 python3 bench/local_kernels.py --json "$D/local_kernels_repeat.json" > "$D/local_kernels_repeat.txt" 2>&1
echo "local_kernels (repeat) rc=$? in ${SECONDS}s"; sed -n 1,16p "$D/local_kernels_repeat.txt"
SECONDS=0
timeout 200 python3 bench/fused_norm_sim.py --lib main=$V/libsymcomm_main.so --json "$D/fused_norm_sim.json" \
  > "$D/fused_norm_sim.txt" 2>&1
echo "fused_norm_sim rc=$? in ${SECONDS}s"; head -30 "$D/fused_norm_sim.txt"
