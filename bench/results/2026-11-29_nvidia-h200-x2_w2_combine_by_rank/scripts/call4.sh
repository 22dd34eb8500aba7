#!/usr/bin/env bash
# Session 15, call 4 (world 2): the batched-members experiment: build, tests/gpu_sim's EP file, the MoE sweep.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; mkdir -p $OUT/c4
echo "$COMMIT" > $OUT/c4/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/c4/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 120 env CUDA_VISIBLE_DEVICES=0 CUDA_MODULE_LOADING=EAGER SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim/test_sim_ep.py -q -rs -p no:cacheprovider >$OUT/c4/gpu_sim.log 2>&1
echo "gpu_sim ep rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/c4/gpu_sim.log | tail -1)"
timeout 200 symcomm-bench moe -g 2 --tokens 1,8,64,512,2048 -n 10 -w 3 -G 10 -R 3 --algo all --json $OUT/c4/moe.json >$OUT/c4/moe.log 2>&1
echo "moe rc $? at ${SECONDS}s"; grep -A9 "Summary: out-of-place" $OUT/c4/moe.log | grep -E "^│" | cut -d'│' -f2,6,7,8,9,10
tar -czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4
