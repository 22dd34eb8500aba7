#!/usr/bin/env bash
# Session 23, call 4 (world 2): custom-twoshot-push as its own path; its tests, a re-tune, auto.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/c4; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SYMCOMM_REQUIRE_GPU=1 timeout 100 torchrun --nproc-per-node=2 --no-python bash -c 'python3 -m pytest tests/gpu/test_custom_ar.py -q -rs -p no:cacheprovider -k "twoshot_push or captured_one_shot"' >$D/gpu.log 2>&1
echo "gpu rc $? at ${SECONDS}s"; grep -E "passed|failed" $D/gpu.log | tail -2
timeout 90 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o $D/nvidia_h200_w2.json >$D/tune.log 2>&1
echo "tune rc $? at ${SECONDS}s"
cp $D/nvidia_h200_w2.json symcomm/tuning/nvidia_h200_w2.json
c=(-g 2 -n 20 -w 5 -G 10 -R 3 -f 4)
timeout 100 symcomm-bench all_reduce "${c[@]}" -b 1K -e 256M --algo auto,custom-twoshot-push,custom-oneshot,symm_mem-twoshot --json $D/ar.json >$D/ar.log 2>&1
echo "ar rc $? at ${SECONDS}s"; grep -E '^ +[0-9]+ ' $D/ar.log | cut -c1-250
git checkout symcomm/tuning/nvidia_h200_w2.json
tar -czf $OUT/c4.tgz -C $OUT c4
