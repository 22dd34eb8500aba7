#!/usr/bin/env bash
# Session 9, device call 7 (the review's fix, final: no split where h aliases an input; the unfused
# path gives the kernel its own input at decode sizes): all of tests/gpu_sim; bench/local_kernels.py
# against the build before the fix (prev) and before this session (main); bench/fused_norm_sim.py
# against prev, started without tests/gpu_sim on PYTHONPATH.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD
D=${OUT:-out}; mkdir -p "$D"; V=build/variants
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  nvcc --version | tail -2; md5sum csrc/* symcomm/_native/*.so $V/*.so; } > "$D/env.txt" 2>&1
SECONDS=0
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim -rs > "$D/gpu_sim.txt" 2>&1
echo "gpu_sim rc=$? in ${SECONDS}s"; grep -E "passed|failed|Error|error" "$D/gpu_sim.txt" | tail -8
SECONDS=0
timeout 200 python3 bench/local_kernels.py --lib prev=$V/libsymcomm_prev.so --lib main=$V/libsymcomm_main.so \
  --json "$D/local_kernels.json" > "$D/local_kernels.txt" 2>&1
echo "local_kernels rc=$? in ${SECONDS}s"; sed -n 1,30p "$D/local_kernels.txt"
SECONDS=0
timeout 150 python3 bench/fused_norm_sim.py --lib prev=$V/libsymcomm_prev.so --json "$D/fused_norm_sim.json" \
  > "$D/fused_norm_sim.txt" 2>&1
echo "fused_norm_sim rc=$? in ${SECONDS}s"; head -14 "$D/fused_norm_sim.txt"
SECONDS=0
timeout 150 torchrun --nproc-per-node=1 scripts/world1_check.py > "$D/world1_check.txt" 2>&1
echo "world1_check rc=$? in ${SECONDS}s"; tail -2 "$D/world1_check.txt"
SECONDS=0
timeout 170 torchrun --nproc-per-node=1 scripts/examples_world1.py > "$D/examples_world1.txt" 2>&1
echo "examples_world1 rc=$? in ${SECONDS}s"; tail -3 "$D/examples_world1.txt"
