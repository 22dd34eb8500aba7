#!/usr/bin/env bash
# One H200: FSDP without record_stream, the example and every example at world 1, plus gpu_sim's training graphs.
set -uo pipefail
OUT=$1; TAG=${TAG:-f2}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff > $OUT/$TAG/diff.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 100 torchrun --nproc-per-node=1 examples/fsdp_train_step.py >$OUT/$TAG/example_fsdp.log 2>&1
echo "fsdp example rc $? at ${SECONDS}s: $(grep -E 'PASS|FAIL' $OUT/$TAG/example_fsdp.log | tail -1 | cut -c1-200)"
timeout 200 torchrun --nproc-per-node=1 scripts/examples_world1.py --list >$OUT/$TAG/examples_world1.log 2>&1
echo "examples_world1 rc $? at ${SECONDS}s"; grep -E "checks passed|FAIL|many graphs|examples_world1" $OUT/$TAG/examples_world1.log | tail -14
timeout 120 torchrun --nproc-per-node=1 diag/fsdp_streams.py >$OUT/$TAG/streams.log 2>&1; echo "streams rc $? at ${SECONDS}s"; grep -E "us/step|overlapping" $OUT/$TAG/streams.log
