#!/usr/bin/env bash
# Session 19, call 2 (world 2): the widest flag-free grid (4N = 128 blocks) against 2N, from one
# diagnostic build whose flagfree_grid takes the widest grid's threshold from SYMCOMM_DIAG_WIDEST
# (vectors per thread of the narrow grid; a patch made here, never committed). Then the
# simulated-rank tests on the same build (unset, the threshold is the committed 8).   bash diag/w13/dev2.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/e; mkdir -p $D
cp csrc/peer.cuh /tmp/peer.cuh.orig
sed -i 's|^constexpr size_t kFlagFreeWidestFrom = 8;|static const size_t kFlagFreeWidestFrom = std::getenv("SYMCOMM_DIAG_WIDEST") ? std::atoi(std::getenv("SYMCOMM_DIAG_WIDEST")) : 8;|' csrc/peer.cuh
sed -i 's|#include <cstddef>|#include <cstddef>\n#include <cstdlib>|' csrc/peer.cuh
grep -c SYMCOMM_DIAG_WIDEST csrc/peer.cuh
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
c=(-g 2 -n 20 -w 5 -G 10 -R 3)
run() {  # $1 threshold (1: 4N from 256 KiB a peer; 1000000: never)
  local t=$1
  SYMCOMM_DIAG_WIDEST=$t timeout 60 symcomm-bench all_reduce "${c[@]}" -b 512K -e 4M -f 2 --algo custom-flagfree >$D/ar_t$t.log 2>&1; echo -n "ar $? "
  SYMCOMM_DIAG_WIDEST=$t timeout 60 symcomm-bench all_gather "${c[@]}" -b 1M -e 8M -f 2 --algo custom-flagfree >$D/ag_t$t.log 2>&1; echo -n "ag $? "
  SYMCOMM_DIAG_WIDEST=$t timeout 60 symcomm-bench reduce_scatter "${c[@]}" -b 1M -e 8M -f 2 --algo custom-flagfree >$D/rs_t$t.log 2>&1; echo -n "rs $? "
  SYMCOMM_DIAG_WIDEST=$t timeout 60 symcomm-bench all_gatherv "${c[@]}" -b 1536K -e 6M -f 2 --algo custom-flagfree >$D/agv_t$t.log 2>&1; echo -n "agv $? "
  SYMCOMM_DIAG_WIDEST=$t timeout 60 symcomm-bench reduce_scatterv "${c[@]}" -b 1536K -e 6M -f 2 --algo custom-flagfree >$D/rsv_t$t.log 2>&1; echo -n "rsv $? "
  SYMCOMM_DIAG_WIDEST=$t timeout 60 symcomm-bench all_gatherv_fp4 "${c[@]}" -b 1M -e 16M -f 2 --algo fused-flagfree >$D/fp4_t$t.log 2>&1; echo "fp4 $? at ${SECONDS}s"
}
run 1000000; run 1
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_collectives.py \
  tests/gpu_sim/test_sim_flagfree_fp4.py tests/gpu_sim/test_sim_epochs.py tests/gpu_sim/test_sim_safety.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s: $(tail -1 $D/sim.log)"
for f in $D/*_t*.log; do echo "== $f"; grep -E "^ +[0-9]+ " $f | awk '{print $1, $6}' | tr '\n' ' '; echo; done
tar -czf $OUT/e.tgz -C $OUT e
