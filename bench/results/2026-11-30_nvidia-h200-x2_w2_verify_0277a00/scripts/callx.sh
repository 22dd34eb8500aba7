#!/usr/bin/env bash
# Session 16: MoE decode with the early dependent signal off (as shipped) and on (diagnostic), ABAB.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
SECONDS=0; mkdir -p $OUT/x
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/x/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
ARGS=(moe --tokens 1,8,64 --algo all -n 10 -w 3 -G 10 -R 3)
for round in 1 2; do
  timeout 90 torchrun --nproc-per-node=2 -m symcomm.bench "${ARGS[@]}" --json $OUT/x/off$round.json >$OUT/x/off$round.log 2>&1
  echo "off$round rc $? at ${SECONDS}s"
  timeout 90 torchrun --nproc-per-node=2 diag/w10/early.py "${ARGS[@]}" --json $OUT/x/on$round.json >$OUT/x/on$round.log 2>&1
  echo "on$round rc $? at ${SECONDS}s"
done
tar -czf $OUT/x.tgz -C $OUT x && rm -rf $OUT/x
