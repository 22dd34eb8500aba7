#!/usr/bin/env bash
# Session 37, one H200, call 3: the final commit after the reread (the dispatch's buffer table
# cached, out= names looked up once; run_example's pool argument): tests/gpu_sim, the MoE sweep
# at world 1, the examples at world 1 (eager, graphs, compiled), in what device time was left.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/c3; mkdir -p $S; SECONDS=0
pk() { tar -czf $OUT/c3.tgz -C $OUT c3; }
echo "${COMMIT:-?}" > $S/commit.txt; git status --short | grep -v "^?? diag" >> $S/commit.txt
nvidia-smi -L > $S/gpus.txt; python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"; pk
timeout 100 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/moe_w1.txt 2>&1
echo "moe w1 rc $? at ${SECONDS}s: $(grep -cE '^ +[0-9]+ ' $S/moe_w1.txt) rows, $(grep -c 'Out of bounds values : 0 OK' $S/moe_w1.txt) OOB-0"; pk
timeout 100 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"; pk
