#!/usr/bin/env bash
# Session 31, one H200, the session's last code commit: a one-GPU user's commands, the compiled
# examples, the CPU API tests on the image's torch, the simulated-rank suite, and the eager host
# cost of a 1 KiB all_reduce at world 1, this tree's package against e703c7e's (the session's
# start; csrc/ is unchanged, so both load the library built here), alternated three times.
#   COMMIT=<sha> bash scripts/verify.sh $OUT     (e703c7e's symcomm/ unpacked in diag/old)
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
echo "$COMMIT" > $S/commit.txt; nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
cp -r symcomm/_native diag/old/symcomm/
for i in 1 2 3; do for v in old new; do
  root=$PWD; [ $v = old ] && root=$PWD/diag/old
  timeout 60 torchrun --nproc-per-node=1 scripts/eager_wrap.py $root --rounds 100 --json $S/eager_${v}_$i.json >$S/eager_${v}_$i.txt 2>&1
  echo "eager $v $i rc $? at ${SECONDS}s: $(grep 'symcomm from' $S/eager_${v}_$i.txt | cut -c1-60) | $(grep 'overhead over' $S/eager_${v}_$i.txt)"
done; done
timeout 60 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$S/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -c '^ *[0-9]' $S/readme_bench.txt) rows"
timeout 40 torchrun --nproc-per-node=1 examples/quickstart.py >$S/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$S/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $S/world1.txt)"
timeout 120 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gloo_api.py tests/test_fp4.py -k "gloo_api or bad_input or compile" >$S/cpu_api.txt 2>&1; echo "cpu api tests rc $? at ${SECONDS}s: $(tail -1 $S/cpu_api.txt)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
