#!/usr/bin/env bash
# Session 9, device call 1: build, all of tests/gpu_sim, bench/fused_norm_sim.py against main's build.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD:$PWD/tests/gpu_sim
D=${OUT:-out}; mkdir -p "$D"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  nvcc --version | tail -2; md5sum csrc/* build/variants/*.so; } > "$D/env.txt" 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . > "$D/build.log" 2>&1 || { tail -20 "$D/build.log"; exit 1; }
grep -h "native library" "$D/build.log"
SECONDS=0
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim -rs > "$D/gpu_sim.txt" 2>&1
echo "gpu_sim rc=$? in ${SECONDS}s"; tail -3 "$D/gpu_sim.txt"
SECONDS=0
timeout 200 python3 bench/fused_norm_sim.py --lib main=build/variants/libsymcomm_main.so --json "$D/fused_norm_sim.json" \
  > "$D/fused_norm_sim.txt" 2>&1
echo "fused_norm_sim rc=$? in ${SECONDS}s"; cat "$D/fused_norm_sim.txt"
{ which ncu nsys; ncu --version; } 2>&1 | head -5
