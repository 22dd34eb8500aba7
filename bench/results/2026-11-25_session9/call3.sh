#!/usr/bin/env bash
# Session 9, device call 3: bench/local_kernels.py with main's build and two variants of the
# no-residual norm's register cap (yb6, yb8); Nsight Compute stall reasons and SASS of the
# standalone norm at decode sizes (bf16 / FP8 / NVFP4, scale on the device and by value).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 SYMCOMM_REQUIRE_GPU=1
export PYTHONPATH=$PWD
D=${OUT:-out}; mkdir -p "$D"; S=bench/results/2026-11-25_session9; V=build/variants
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())'
  md5sum csrc/* symcomm/_native/*.so $V/*.so; } > "$D/env.txt" 2>&1
SECONDS=0
timeout 330 python3 bench/local_kernels.py --lib main=$V/libsymcomm_main.so --lib yb6=$V/libsymcomm_yb6.so \
  --lib yb8=$V/libsymcomm_yb8.so --json "$D/local_kernels.json" > "$D/local_kernels.txt" 2>&1
echo "local_kernels rc=$? in ${SECONDS}s"; cat "$D/local_kernels.txt"
SECONDS=0
timeout 120 ncu --cache-control none --clock-control none -k regex:rmsnorm_kernel \
  --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__cycles_active.max,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
  python3 $S/ncu_norm.py > "$D/ncu_stalls.txt" 2>&1
echo "ncu rc=$? in ${SECONDS}s"; grep -E "^tokens|rmsnorm_kernel<|duration|inst_executed|long_scoreboard|no_instruction|barrier|imc_miss|wait " "$D/ncu_stalls.txt" | head -120
cuobjdump -sass symcomm/_native/*.so | awk '/Function : .*rmsnorm_kernelI13__nv_bfloat16Li4ELi[01]ELb1E/{p=1} p{print} p&&/^\s+\.{5,}/{p=0}' > "$D/norm_sass.txt" 2>&1
wc -l "$D/norm_sass.txt"
