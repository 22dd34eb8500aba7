#!/usr/bin/env bash
# Session 8's last one-GPU call: the merged tree (issues 23-26, 28, 29) checked where one GPU can.
# Run from the repository root on the device: OUT=$OUT bash bench/results/2026-11-25_session8/callC_final/callC.sh
# carrying symcomm/_native and build/nvcc-cache (objects built on the CPU machine: pip only links).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT/c; mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  nvcc --version | tail -1; } > $R/env.txt 2>&1
t() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $R/summary.txt; }
python3 -m pip install --no-build-isolation --no-deps -e . > $R/install.txt 2>&1; t install $?
grep -h "native library" $R/install.txt | tee -a $R/summary.txt
# Simulated ranks: every peer kernel's logic (EP W=2,4,8 included), a GPU test that skips fails.
PYTHONPATH=$PWD:$PWD/tests SYMCOMM_REQUIRE_GPU=1 timeout 200 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider > $R/gpu_sim.txt 2>&1; t gpu_sim $?
tail -3 $R/gpu_sim.txt | tee -a $R/summary.txt
grep -h "unwaiting" $R/gpu_sim.txt | head -5 | tee -a $R/summary.txt
# Every public op at world 1 (graph comms on/off, autograd, leak loop), then every example.
PYTHONPATH=$PWD timeout 150 torchrun --nproc-per-node=1 scripts/world1_check.py > $R/world1_check.txt 2>&1; t world1_check $?
grep -E "FAIL|checks passed|memory loop" $R/world1_check.txt | cut -c1-300 | tee -a $R/summary.txt
PYTHONPATH=$PWD timeout 200 torchrun --nproc-per-node=1 scripts/examples_world1.py > $R/examples_world1.txt 2>&1; t examples_world1 $?
grep -E "FAIL|passed|checks" $R/examples_world1.txt | tail -12 | cut -c1-300 | tee -a $R/summary.txt
# The README's commands on one GPU, as written (the first without its pip halves: no network).
timeout 60 python3 -m symcomm > $R/about.txt 2>&1; t about $?
timeout 150 symcomm-bench all_reduce -g 2 -b 1K -e 1M > $R/readme_bench_g2.txt 2>&1; t readme_bench_g2 $?
timeout 120 symcomm-bench all_reduce -g 1 -b 1K -e 1M > $R/readme_bench_g1.txt 2>&1; t readme_bench_g1 $?
timeout 120 symcomm-bench moe -g 1 --tokens 8,128 --hidden 7168 --topk 8 --experts 256 -n 5 -w 2 > $R/bench_moe_g1.txt 2>&1; t bench_moe_g1 $?
# The FSDP rows of the training bench, which failed before the pool fallback (world 1: no traffic).
PYTHONPATH=$PWD timeout 120 torchrun --nproc-per-node=1 bench/train_step.py --tokens 64,512 --json $R/train_step_w1.json > $R/train_step_w1.txt 2>&1; t train_step_w1 $?
tar -czf $OUT/c.tgz -C $OUT c && rm -rf $R
