#!/usr/bin/env bash
# Session 18, call 1 (world 2): the flag-free kernels with grouped loads. Tests on the new build,
# then the same sweeps on the base build (HEAD's three files, diag/w12/base) and the new one.
#   bash diag/w12/dev.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/d; mkdir -p $D/new $D/base
cp csrc/custom_ar.cu csrc/peer.cuh csrc/peer_gather.cu $D/   # the new files
build() { python3 -m pip install --no-build-isolation --no-deps -e . >$D/build_$1.log 2>&1; echo "build $1 rc $? at ${SECONDS}s"; }
sweeps() {  # $1: folder
  local f=$1 c=(-g 2 -n 20 -w 5 -G 10 -R 3)
  timeout 60 symcomm-bench all_gather "${c[@]}" -b 256K -e 4M -f 2 --algo custom-flagfree,custom-push,auto >$f/ag.log 2>&1; echo -n "ag $? "
  timeout 60 symcomm-bench reduce_scatter "${c[@]}" -b 256K -e 4M -f 2 --algo custom-flagfree,custom-oneshot,auto >$f/rs.log 2>&1; echo -n "rs $? "
  timeout 60 symcomm-bench all_reduce "${c[@]}" -b 256K -e 2M -f 2 --algo custom-flagfree,custom-oneshot,custom-twoshot,auto >$f/ar.log 2>&1; echo -n "ar $? "
  timeout 60 symcomm-bench all_gatherv "${c[@]}" -b 384K -e 3M -f 2 --algo custom-flagfree,custom-push,auto >$f/agv.log 2>&1; echo -n "agv $? "
  timeout 60 symcomm-bench reduce_scatterv "${c[@]}" -b 384K -e 3M -f 2 --algo custom-flagfree,custom-oneshot,auto >$f/rsv.log 2>&1; echo -n "rsv $? "
  timeout 90 symcomm-bench all_gatherv_fp4 "${c[@]}" -b 1M -e 16M -f 2 --algo all >$f/fp4.log 2>&1; echo "fp4 $? at ${SECONDS}s"
}
build new
nvidia-smi -L > $D/gpus.txt
SYMCOMM_REQUIRE_GPU=1 timeout 200 torchrun --nproc-per-node=2 --no-python bash -c \
  "python3 -X faulthandler -m pytest tests/gpu/test_flagfree_collectives.py tests/gpu/test_custom_ar.py tests/gpu/test_fp4_gpu.py tests/gpu/test_peer_chunks.py -q -rs -p no:cacheprovider >$D/gpu_r\$RANK.log 2>&1"
echo "gpu rc $? at ${SECONDS}s: r0 $(tail -1 $D/gpu_r0.log) | r1 $(tail -1 $D/gpu_r1.log)"
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_collectives.py \
  tests/gpu_sim/test_sim_flagfree_fp4.py tests/gpu_sim/test_sim_epochs.py tests/gpu_sim/test_sim_safety.py -p no:cacheprovider >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s: $(tail -1 $D/sim.log)"
cp diag/w12/base/* csrc/ && build base && sweeps $D/base
cp $D/custom_ar.cu $D/peer.cuh $D/peer_gather.cu csrc/ && build new2 && sweeps $D/new
tar -czf $OUT/d.tgz -C $OUT d
