#!/usr/bin/env bash
# Session 23, call 3 (world 2): the wide push grid; re-tune, then auto beside the paths.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/c3; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SYMCOMM_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ranks.py >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s"; tail -1 $D/sim.log
timeout 90 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o $D/nvidia_h200_w2.json >$D/tune.log 2>&1
echo "tune rc $? at ${SECONDS}s"
cp $D/nvidia_h200_w2.json symcomm/tuning/nvidia_h200_w2.json
c=(-g 2 -n 20 -w 5 -G 10 -R 3 -f 4)
timeout 100 symcomm-bench all_reduce "${c[@]}" -b 1K -e 256M --algo auto,custom-twoshot,custom-oneshot,symm_mem-twoshot --json $D/ar.json >$D/ar.log 2>&1
echo "ar rc $? at ${SECONDS}s"; grep -E '^ +[0-9]+ ' $D/ar.log | cut -c1-250
timeout 60 symcomm-bench all_gather "${c[@]}" -b 1M -e 256M --algo auto,custom-push --json $D/ag.json >$D/ag.log 2>&1
echo "ag rc $? at ${SECONDS}s"; grep -E '^ +[0-9]+ ' $D/ag.log | cut -c1-200
git checkout symcomm/tuning/nvidia_h200_w2.json
tar -czf $OUT/c3.tgz -C $OUT c3
