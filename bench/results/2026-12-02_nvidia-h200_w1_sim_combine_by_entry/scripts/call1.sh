#!/usr/bin/env bash
# Session 34, one H200: build the branch, the whole simulated-rank suite (W = 2, 4, 8; EP kernels
# bitwise against the reference, by entry and by rank), the examples at world 1, the MoE CLI at
# world 1 with its check, and the CPU EP tests on the image's torch.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
git log -1 --format=%H > $S/commit.txt 2>/dev/null; git status --short | grep -v "^?? diag" >> $S/commit.txt
nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^(FAILED|ERROR)" $S/gpu_sim.txt | head -8
timeout 130 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep 'Out of bounds' $S/bench_moe_w1.txt)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_ep_layout.py tests/test_ep_gloo.py >$S/cpu_ep.txt 2>&1; echo "cpu ep tests rc $? at ${SECONDS}s: $(tail -1 $S/cpu_ep.txt)"
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
