#!/usr/bin/env bash
# Session 32, one H200, the session's last code commit: build, a one-GPU user's commands, the
# compiled examples, the CPU tests this session touched on the image's torch, the simulated-rank
# suite, and the eager host cost of a 1 KiB all_reduce at world 1.
#   COMMIT=<sha> bash diag/w32/verify.sh $OUT   (kept here as scripts/verify.sh)
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
echo "$COMMIT" > $S/commit.txt; nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 60 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$S/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -c '^ *[0-9]' $S/readme_bench.txt) rows, $(grep 'Out of bounds' $S/readme_bench.txt)"
timeout 40 torchrun --nproc-per-node=1 examples/quickstart.py >$S/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$S/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $S/world1.txt)"
timeout 120 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gloo_api.py tests/test_ep_gloo.py -k "refus or disagree or bad or check_mode or compile" >$S/cpu_api.txt 2>&1; echo "cpu api tests rc $? at ${SECONDS}s: $(tail -1 $S/cpu_api.txt)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
timeout 60 torchrun --nproc-per-node=1 bench/eager_overhead.py --rounds 40 --json $S/eager.json >$S/eager.txt 2>&1; echo "eager rc $? at ${SECONDS}s: $(grep 'overhead over' $S/eager.txt)"
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
