#!/usr/bin/env bash
# Session 29, one H200: what a one-GPU user runs (README bench, world1_check, quickstart), tests/gpu at world 1,
# and the simulated-rank suite (W = 2, 4, 8 on one GPU). Usage: COMMIT=<sha> bash diag/w29/one_gpu.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/s; SECONDS=0
echo "$COMMIT" > $OUT/s/commit.txt; nvidia-smi -L > $OUT/s/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $OUT/s/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/s/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
grep -i "native\|ptxas\|error" $OUT/s/build.log | tail -3
timeout 60 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$OUT/s/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -c '^ *[0-9]' $OUT/s/readme_bench.txt) rows"; grep -E "Native|device" $OUT/s/readme_bench.txt | head -3
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$OUT/s/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $OUT/s/world1.txt)"
timeout 40 torchrun --nproc-per-node=1 examples/quickstart.py >$OUT/s/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
timeout 200 torchrun --nproc-per-node=1 -m pytest -q -p no:cacheprovider tests/gpu >$OUT/s/tests_gpu_w1.txt 2>&1
echo "tests/gpu w1 rc $? at ${SECONDS}s: $(tail -1 $OUT/s/tests_gpu_w1.txt)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$OUT/s/gpu_sim.txt 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $OUT/s/gpu_sim.txt)"
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s
