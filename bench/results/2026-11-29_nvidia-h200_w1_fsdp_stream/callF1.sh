#!/usr/bin/env bash
# One H200, eleventh session: the FSDP step with its collectives on a communication stream.
set -uo pipefail
OUT=$1; TAG=${TAG:-f1}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git status --short | grep -v '^??' >> $OUT/$TAG/commit.txt
nvidia-smi -L > $OUT/$TAG/env.txt; python3 -c "import torch;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> $OUT/$TAG/env.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 100 torchrun --nproc-per-node=1 examples/fsdp_train_step.py >$OUT/$TAG/example_fsdp.log 2>&1
echo "fsdp example rc $? at ${SECONDS}s: $(grep -E 'PASS|FAIL' $OUT/$TAG/example_fsdp.log | tail -1 | cut -c1-200)"
grep -i "overlapped\|FAIL" $OUT/$TAG/example_fsdp.log | head -8
timeout 120 torchrun --nproc-per-node=1 diag/fsdp_streams.py >$OUT/$TAG/streams.log 2>&1; echo "streams rc $? at ${SECONDS}s"; tail -40 $OUT/$TAG/streams.log
timeout 200 torchrun --nproc-per-node=1 scripts/examples_world1.py --list >$OUT/$TAG/examples_world1.log 2>&1
echo "examples_world1 rc $? at ${SECONDS}s"; grep -v "^ok" $OUT/$TAG/examples_world1.log | tail -14; grep -c "overlapped" $OUT/$TAG/examples_world1.log
timeout 120 torchrun --nproc-per-node=1 bench/train_step.py --steps fsdp --iters 10 --rounds 3 --json $OUT/$TAG/train_step.json >$OUT/$TAG/train_step.log 2>&1
echo "train_step rc $? at ${SECONDS}s"; cat $OUT/$TAG/train_step.log | tail -16
