#!/usr/bin/env bash
# Session 38, one H200, call 4: the final commit (main + the words scale copy + the layout patch)
# as the one-GPU verification: tests/gpu_sim whole, the examples at world 1, the MoE CLI at world 1
# (every row's out-of-bounds check). Two simulated ranks for what needs peers; no NVLink.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s4; mkdir -p $S; SECONDS=0
git status --short | grep -v "^?? diag" > $S/status.txt
git log --oneline -1 >> $S/status.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $S/gpu.txt
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' >> $S/gpu.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
tar -czf $OUT/s4.tgz -C $OUT s4
timeout 120 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
tar -czf $OUT/s4.tgz -C $OUT s4
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep -c 'Out of bounds values : 0 OK' $S/bench_moe_w1.txt) rows OOB 0 of $(grep -c 'Out of bounds' $S/bench_moe_w1.txt)"
tar -czf $OUT/s4.tgz -C $OUT s4 && rm -rf $S
