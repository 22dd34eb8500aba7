#!/usr/bin/env bash
# Session 37, one H200, call 1 (run as diag/w37/call1.sh, copied here as scripts/call1.sh): the dispatch buffers from one table (buffer_specs) and
# moe_dispatch_nbytes, on a GPU: tests/gpu_sim (SimComm builds every dispatch through
# MoeDispatch.build), the MoE sweep at world 1 (moe_spec carves its buffers from the specs and
# passes them as out=), the examples at world 1 (the EP example allocates inside
# use_symmetric_memory), bench/layer_step.py's EP step (its pool sized by moe_dispatch_nbytes),
# then the README's benchmark command and world1_check.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/c1; mkdir -p $S; SECONDS=0
pk() { tar -czf $OUT/c1.tgz -C $OUT c1; }
echo "${COMMIT:-?}" > $S/commit.txt; git status --short | grep -v "^?? diag" >> $S/commit.txt
nvidia-smi -L > $S/gpus.txt; python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"; pk
timeout 100 symcomm-bench moe -g 1 -b 114688 -e 7340032 >$S/moe_w1.txt 2>&1
echo "moe w1 rc $? at ${SECONDS}s: $(grep -cE '^ +[0-9]+ ' $S/moe_w1.txt) rows, $(grep -c 'Out of bounds values : 0 OK' $S/moe_w1.txt) OOB-0"; pk
timeout 100 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"; pk
timeout 120 torchrun --nproc-per-node=1 bench/layer_step.py --layers ep_moe --ep-experts 32 --tokens 1,64,2048 --iters 3 --rounds 1 --json $S/layer_step_ep.json >$S/layer_step_ep.txt 2>&1
echo "layer_step ep_moe rc $? at ${SECONDS}s"; tail -8 $S/layer_step_ep.txt; pk
timeout 90 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$S/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -cE '^ +[0-9]+ ' $S/readme_bench.txt) rows, $(grep -c 'Out of bounds values : 0 OK' $S/readme_bench.txt) OOB-0"
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$S/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $S/world1.txt)"; pk
