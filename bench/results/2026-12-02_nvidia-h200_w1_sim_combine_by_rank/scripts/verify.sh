#!/usr/bin/env bash
# Session 33, one H200, the branch's commit: build, the whole simulated-rank suite (W = 2, 4, 8;
# the EP kernels bitwise against the reference), dispatch and dispatch + combine on two simulated
# ranks for main (diag/w33/old, 77a1513) and the branch alternated twice, the compiled examples
# at world 1 (the EP step's a2a path, graphs, torch.compile), the MoE CLI at world 1 with its
# check, and the CPU EP tests on the image's torch.
#   COMMIT=<sha> bash diag/w33/verify.sh $OUT   (kept as scripts/verify.sh)
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
echo "$COMMIT" > $S/commit.txt; nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 210 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
grep -E "^FAILED" $S/gpu_sim.txt | head -5
NEW=$PWD
for round in 1 2; do
  (cd diag/w33/old && PYTHONPATH=$PWD timeout 60 python3 $NEW/diag/w33/ep_time.py old >>$S/time.txt 2>&1); echo "old $round rc $? at ${SECONDS}s"
  timeout 60 python3 diag/w33/ep_time.py new >>$S/time.txt 2>&1; echo "new $round rc $? at ${SECONDS}s"
done
timeout 130 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 60 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/bench_moe_w1.txt 2>&1; echo "bench moe w1 rc $? at ${SECONDS}s: $(grep 'Out of bounds' $S/bench_moe_w1.txt)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_ep_layout.py tests/test_ep_gloo.py >$S/cpu_ep.txt 2>&1; echo "cpu ep tests rc $? at ${SECONDS}s: $(tail -1 $S/cpu_ep.txt)"
grep -E "tokens" $S/time.txt | sed -E 's/ +/ /g' | cut -d' ' -f1,3,5,7,10,12,14
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
