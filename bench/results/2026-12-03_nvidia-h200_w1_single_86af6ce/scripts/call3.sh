#!/usr/bin/env bash
# Session 36, one H200, call 3: the session's last code commit as a one-GPU user runs it: the
# README's benchmark command, the quickstart, world1_check, the examples at world 1; the verify
# mode's MoE sweep at world 1 (the new refused-column rule, end to end); bench/layer_step.py's EP
# step at world 1 (its new pool reservation); tests/gpu_sim last.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s3; mkdir -p $S; SECONDS=0
echo "${COMMIT:-?}" > $S/commit.txt; git status --short | grep -v "^?? diag" >> $S/commit.txt
nvidia-smi -L > $S/gpus.txt; python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 90 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$S/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -cE '^ +[0-9]+ ' $S/readme_bench.txt) rows, $(grep -c 'Out of bounds values : 0 OK' $S/readme_bench.txt) OOB-0 lines"
timeout 60 torchrun --nproc-per-node=1 examples/quickstart.py >$S/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$S/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $S/world1.txt)"
timeout 100 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
WORLD=1 PART=2 ONLY="bench_moe" COMMIT=${COMMIT:-?} SKIP_BUILD=1 timeout 150 bash scripts/gpu_check.sh verify $S/v >$S/verify_moe.txt 2>&1
echo "verify bench_moe rc $? at ${SECONDS}s:"; grep -E "^bench_moe|^verify:" $S/verify_moe.txt
timeout $((270 - SECONDS)) torchrun --nproc-per-node=1 bench/layer_step.py --layers ep_moe --tokens 1,64 --iters 3 --rounds 1 --json $S/layer_step_ep.json >$S/layer_step_ep.txt 2>&1
echo "layer_step ep_moe rc $? at ${SECONDS}s"; tail -6 $S/layer_step_ep.txt
left=$((280 - SECONDS)); if ((left > 140)); then
  timeout $left python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
else echo "gpu_sim: not run ($left s left)"; fi
tar -czf $OUT/s3.tgz -C $OUT s3 && rm -rf $S
