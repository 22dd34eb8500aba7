#!/usr/bin/env bash
# Session 23, call 1 (world 2): two-shot by stores. Sim tests, its GPU tests, an all_reduce sweep
# beside one-shot and PyTorch's two-shot, then a re-tune.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/c1; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SYMCOMM_REQUIRE_GPU=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ranks.py -k "two_shot_by_stores or in_place or many_calls" >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s"; tail -3 $D/sim.log
SYMCOMM_REQUIRE_GPU=1 timeout 150 torchrun --nproc-per-node=2 --no-python bash -c 'python3 -m pytest tests/gpu/test_custom_ar.py -q -rs -p no:cacheprovider -k "two_shot_into or captured_one_shot or graph_replay or symmetric"' >$D/gpu.log 2>&1
echo "gpu rc $? at ${SECONDS}s"; grep -E "passed|failed|Error" $D/gpu.log | tail -6
c=(-g 2 -n 20 -w 5 -G 10 -R 3 -b 1M -e 256M -f 4)
timeout 120 symcomm-bench all_reduce "${c[@]}" --algo custom-twoshot,custom-oneshot,symm_mem-twoshot --json $D/ar.json >$D/ar.log 2>&1
echo "ar rc $? at ${SECONDS}s"; grep -E '^ +[0-9]+ ' $D/ar.log | cut -c1-200
timeout 100 symcomm-bench all_reduce "${c[@]}" --algo custom-twoshot,custom-oneshot,symm_mem-twoshot --json $D/ar2.json >$D/ar2.log 2>&1
echo "ar2 rc $? at ${SECONDS}s"; grep -E '^ +[0-9]+ ' $D/ar2.log | cut -c1-200
timeout 90 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o $D/nvidia_h200_w2.json >$D/tune.log 2>&1
echo "tune rc $? at ${SECONDS}s"
tar -czf $OUT/c1.tgz -C $OUT c1
