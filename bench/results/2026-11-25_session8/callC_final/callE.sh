#!/usr/bin/env bash
# After the compile fixes: every example at world 1 again, the moe bench
# (the README test command runs alone: callF.sh).
# OUT=$OUT bash .../callE.sh   (carry symcomm/_native and build/nvcc-cache)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT/e; mkdir -p $R
t() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $R/summary.txt; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $R/env.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . > $R/install.txt 2>&1; t install $?
PYTHONPATH=$PWD timeout 200 torchrun --nproc-per-node=1 scripts/examples_world1.py > $R/examples_world1.txt 2>&1; t examples_world1 $?
grep -E "FAIL|checks passed" $R/examples_world1.txt | cut -c1-300 | tee -a $R/summary.txt
timeout 90 symcomm-bench moe -g 1 --tokens 8,128 --hidden 7168 --topk 8 --experts 256 -n 5 -w 2 > $R/bench_moe_g1.txt 2>&1; t bench_moe_g1 $?
tar -czf $OUT/e.tgz -C $OUT e && rm -rf $R
