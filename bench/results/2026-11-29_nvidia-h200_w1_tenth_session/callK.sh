#!/usr/bin/env bash
# One H200, tenth session, final code: build, simulated ranks, the two MoE examples at world 1
# (eager, graphs, compile; the DP one with both gathers), then the README's commands (single).
set -uo pipefail
OUT=$1; TAG=${TAG:-k}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git status --short | grep -v '^??' >> $OUT/$TAG/commit.txt
nvidia-smi -L > $OUT/$TAG/env.txt; python3 -c "import torch;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> $OUT/$TAG/env.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 200 env SYMCOMM_REQUIRE_GPU=1 CUDA_MODULE_LOADING=EAGER python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)" $OUT/$TAG/gpu_sim.log | head -5
for ex in "dp_moe_step.py" "ep_moe_step.py" "ep_moe_step.py --quant nvfp4" "ep_moe_step.py --quant fp8"; do
  log=$OUT/$TAG/example_$(echo $ex | tr ' -' '__').log
  timeout 150 torchrun --nproc-per-node=1 examples/$ex >$log 2>&1; rc=$?
  echo "example $ex rc $rc at ${SECONDS}s: $(grep -E 'PASS|FAIL' $log | tail -1 | cut -c1-150)"
done
