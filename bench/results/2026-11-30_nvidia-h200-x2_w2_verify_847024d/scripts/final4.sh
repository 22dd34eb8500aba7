#!/usr/bin/env bash
# Session 19, final lease, call 4 (world 2) on 847024d: auto between the table's rows for the
# uneven ops (3 and 6 MiB), then the nccl-tests compare to 256 MiB.   bash diag/w13/final4.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/g; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
c=(-g 2 -n 20 -w 5 -G 10 -R 3 -b 3M -e 6M -f 2)
timeout 60 symcomm-bench all_gatherv "${c[@]}" --algo custom-flagfree,custom-push,auto >$D/agv.log 2>&1; echo -n "agv $? "
timeout 60 symcomm-bench reduce_scatterv "${c[@]}" --algo custom-flagfree,custom-oneshot,auto >$D/rsv.log 2>&1; echo "rsv $? at ${SECONDS}s"
tar -czf $OUT/g.tgz -C $OUT g
BENCH_MAX=256M ROUNDS=3 P=c BUDGET=$(( 330 - SECONDS )) COMMIT=847024d bash diag/w11/call.sh $OUT
