#!/usr/bin/env bash
# One H200, the branch head after the review fixes: the EP example in three encodings at world 1,
# and the layer bench's EP step (every variant) at two token counts.
set -uo pipefail
OUT=$1; TAG=${TAG:-p}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
for ex in "ep_moe_step.py" "ep_moe_step.py --quant nvfp4" "ep_moe_step.py --quant fp8"; do
  log=$OUT/$TAG/example_$(echo $ex | tr ' -' '__').log
  timeout 60 torchrun --nproc-per-node=1 examples/$ex >$log 2>&1; rc=$?
  echo "example $ex rc $rc at ${SECONDS}s: $(grep -E 'PASS|FAIL' $log | tail -1 | cut -c1-150)"
done
timeout 90 torchrun --nproc-per-node=1 bench/layer_step.py --layers ep_moe --tokens 1,8 --ep-experts 64 --iters 5 --rounds 2 --json $OUT/$TAG/ep.json >$OUT/$TAG/ep.log 2>&1
echo "layer_step ep rc $? at ${SECONDS}s"; grep -E "^\s+ep_moe" $OUT/$TAG/ep.log | cut -c1-100
