#!/usr/bin/env bash
# Session 9, device call 2: bench/fused_norm_sim.py (fixed launch order, no early dependents, alarm
# checks) against main's build; an Nsight Compute probe of the standalone norm at decode sizes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD:$PWD/tests/gpu_sim
D=${OUT:-out}; mkdir -p "$D"; S=bench/results/2026-11-25_session9
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  md5sum csrc/* build/variants/*.so; } > "$D/env.txt" 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . > "$D/build.log" 2>&1 || { tail -20 "$D/build.log"; exit 1; }
SECONDS=0
timeout 240 python3 bench/fused_norm_sim.py --lib main=build/variants/libsymcomm_main.so --json "$D/fused_norm_sim.json" \
  > "$D/fused_norm_sim.txt" 2>&1
echo "fused_norm_sim rc=$? in ${SECONDS}s"; cat "$D/fused_norm_sim.txt"
SECONDS=0
timeout 150 ncu -k regex:rmsnorm_kernel --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  python3 $S/ncu_norm.py > "$D/ncu_norm.txt" 2>&1
echo "ncu rc=$? in ${SECONDS}s"; head -30 "$D/ncu_norm.txt"
