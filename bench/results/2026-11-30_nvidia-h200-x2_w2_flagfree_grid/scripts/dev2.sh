#!/usr/bin/env bash
# Session 18, call 2 (world 2): the flag-free grid, 32 against 64 blocks, from one diagnostic build
# whose contexts take the count from SYMCOMM_DIAG_FF_BLOCKS (a patch made here, never committed).
#   bash diag/w12/dev2.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/e; mkdir -p $D
sed -i 's|  int flagfree_blocks = kFlagFreeBlocks;|  int flagfree_blocks = std::getenv("SYMCOMM_DIAG_FF_BLOCKS") ? std::atoi(std::getenv("SYMCOMM_DIAG_FF_BLOCKS")) : kFlagFreeBlocks;|' csrc/peer.cuh
sed -i 's|#include <cstddef>|#include <cstddef>\n#include <cstdlib>|' csrc/peer.cuh
grep -c SYMCOMM_DIAG_FF_BLOCKS csrc/peer.cuh
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
c=(-g 2 -n 20 -w 5 -G 10 -R 3)
small() {  # $1 blocks, $2 pass
  for op in all_reduce all_gather reduce_scatter; do
    SYMCOMM_DIAG_FF_BLOCKS=$1 timeout 60 symcomm-bench $op "${c[@]}" -R 5 -b 1K -e 64K -f 4 --algo custom-flagfree >$D/small_${op}_b$1_p$2.log 2>&1; echo -n "$op/$1 $? "
  done; echo "at ${SECONDS}s"
}
large() {  # $1 blocks
  local b=$1
  SYMCOMM_DIAG_FF_BLOCKS=$b timeout 60 symcomm-bench all_gather "${c[@]}" -b 512K -e 4M -f 2 --algo custom-flagfree,custom-push >$D/ag_b$b.log 2>&1; echo -n "ag $? "
  SYMCOMM_DIAG_FF_BLOCKS=$b timeout 60 symcomm-bench reduce_scatter "${c[@]}" -b 512K -e 4M -f 2 --algo custom-flagfree,custom-oneshot >$D/rs_b$b.log 2>&1; echo -n "rs $? "
  SYMCOMM_DIAG_FF_BLOCKS=$b timeout 60 symcomm-bench all_reduce "${c[@]}" -b 512K -e 2M -f 2 --algo custom-flagfree,custom-oneshot >$D/ar_b$b.log 2>&1; echo -n "ar $? "
  SYMCOMM_DIAG_FF_BLOCKS=$b timeout 60 symcomm-bench all_gatherv "${c[@]}" -b 768K -e 3M -f 2 --algo custom-flagfree,custom-push >$D/agv_b$b.log 2>&1; echo -n "agv $? "
  SYMCOMM_DIAG_FF_BLOCKS=$b timeout 60 symcomm-bench reduce_scatterv "${c[@]}" -b 768K -e 3M -f 2 --algo custom-flagfree,custom-oneshot >$D/rsv_b$b.log 2>&1; echo -n "rsv $? "
  SYMCOMM_DIAG_FF_BLOCKS=$b timeout 90 symcomm-bench all_gatherv_fp4 "${c[@]}" -b 64K -e 16M -f 4 --algo all >$D/fp4_b$b.log 2>&1; echo "fp4 $? at ${SECONDS}s"
}
small 32 1; small 64 1; large 32; large 64; small 32 2; small 64 2
tar -czf $OUT/e.tgz -C $OUT e
