#!/usr/bin/env bash
# One H200, world 1: the layer steps before (4f4bdc7's examples, diag/old) and after this
# session's example changes, in one call. World 1 has no NVLink: this measures the compute the
# changes remove (EP's capacity-wide elementwise work, DP's FP4 scale, quantize and dequantize).
set -uo pipefail
OUT=$1; TAG=${TAG:-l}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
ARGS="--layers ${LAYERS:-ep_moe,dp_moe} --tokens ${TOKENS:-1,8,64,2048} --ep-experts 64 --iters ${ITERS:-10} --rounds ${ROUNDS:-3}"
for v in old new ${AGAIN:-}; do
  script=bench/layer_step.py; [ $v = old ] && script=diag/old/bench/layer_step.py
  timeout 260 torchrun --nproc-per-node=1 $script $ARGS --json $OUT/$TAG/$v.json >$OUT/$TAG/$v.log 2>&1
  echo "$v rc $? at ${SECONDS}s"; grep -E "^\s+(ep_moe|dp_moe)" $OUT/$TAG/$v.log | cut -c1-110
done
