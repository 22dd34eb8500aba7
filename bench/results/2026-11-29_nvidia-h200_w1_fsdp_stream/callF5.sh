#!/usr/bin/env bash
# One H200: the FSDP example after the review (held gathered weights, loss all-reduce on the comm stream).
set -uo pipefail
OUT=$1; TAG=${TAG:-f5}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff > $OUT/$TAG/diff.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 100 torchrun --nproc-per-node=1 examples/fsdp_train_step.py >$OUT/$TAG/example_fsdp.log 2>&1
echo "fsdp example rc $? at ${SECONDS}s: $(grep -E 'PASS|FAIL' $OUT/$TAG/example_fsdp.log | tail -3 | cut -c1-200)"
timeout 200 torchrun --nproc-per-node=1 scripts/examples_world1.py --list >$OUT/$TAG/examples_world1.log 2>&1
echo "examples_world1 rc $? at ${SECONDS}s"; grep -E "checks passed|FAIL|many graphs|examples_world1|held|let go" $OUT/$TAG/examples_world1.log | tail -16
timeout 120 torchrun --nproc-per-node=1 diag/fsdp_streams.py >$OUT/$TAG/streams.log 2>&1; echo "streams rc $? at ${SECONDS}s"; grep -E "us/step|overlapping" $OUT/$TAG/streams.log
timeout 120 torchrun --nproc-per-node=1 bench/train_step.py --steps fsdp --iters 10 --rounds 3 --json $OUT/$TAG/train_step.json >$OUT/$TAG/train_step.log 2>&1
echo "train_step rc $? at ${SECONDS}s"; grep -E "^ +fsdp|^#" $OUT/$TAG/train_step.log
