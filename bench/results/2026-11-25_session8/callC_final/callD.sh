#!/usr/bin/env bash
# After callC: the two fixes (fp4 codec as torch.library ops under torch.compile; the bench's pool
# sized by the allocator's segments) re-checked. OUT=$OUT bash .../callD.sh, same carry as callC.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT/d; mkdir -p $R
t() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a $R/summary.txt; }
python3 -m pip install --no-build-isolation --no-deps -e . > $R/install.txt 2>&1; t install $?
PYTHONPATH=$PWD timeout 300 torchrun --nproc-per-node=1 scripts/examples_world1.py > $R/examples_world1.txt 2>&1; t examples_world1 $?
grep -E "FAIL|checks passed" $R/examples_world1.txt | cut -c1-300 | tee -a $R/summary.txt
timeout 120 symcomm-bench moe -g 1 --tokens 8,128 --hidden 7168 --topk 8 --experts 256 -n 5 -w 2 > $R/bench_moe_g1.txt 2>&1; t bench_moe_g1 $?
PYTHONPATH=$PWD:$PWD/tests timeout 120 python3 -m pytest tests/test_fp4.py tests/test_bench_specs.py tests/test_autograd.py -q -p no:cacheprovider > $R/cpu_tests_on_gpu_host.txt 2>&1; t cpu_tests $?
tail -1 $R/cpu_tests_on_gpu_host.txt | tee -a $R/summary.txt
tar -czf $OUT/d.tgz -C $OUT d && rm -rf $R
