#!/usr/bin/env bash
# Diagnosis call: build, GPU tests per file with per-rank logs, twoshot capture, benches.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
L=$OUT/logs; mkdir -p $L
trap 'tar -czf $OUT/logs.tgz -C $OUT logs' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader > $L/env.txt
( time python3 -m pip install --no-build-isolation --no-deps -e . ) > $L/build.log 2>&1 || { tail -30 $L/build.log; exit 1; }
echo "build ok $SECONDS"
for f in test_moe test_paths test_fp4_gpu test_custom_ar test_collectives; do
  timeout 240 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
    "python3 -X faulthandler -m pytest tests/gpu/$f.py -q -rs -p no:cacheprovider -x --tb=short >$L/${f}_r\$RANK.log 2>&1"
  echo "$f exit $? at $SECONDS: $(tail -1 $L/${f}_r0.log) | $(tail -1 $L/${f}_r1.log)"
done
grep -h -E "FAILED|Error|error:|Fatal|differ" $L/test_*_r0.log | head -30
for c in 0 1; do
  CHECK=$c timeout 120 torchrun --nproc-per-node=2 diag/twoshot_capture.py > $L/twoshot_check$c.log 2>&1
  echo "twoshot check=$c exit $?"; grep -E "^rank|File|Error" $L/twoshot_check$c.log | head -40
done
timeout 100 symcomm-bench all_gatherv -g 2 -b 1K -e 16M -f 8 -n 5 -w 2 --algo all > $L/agv.log 2>&1; echo "agv exit $?"; grep -E "Buffers|Out of" $L/agv.log
timeout 150 symcomm-bench moe -g 2 --tokens 1,64,512,2048 --algo all -n 5 -w 2 -G 5 > $L/moe.log 2>&1; echo "moe exit $?"; tail -25 $L/moe.log
timeout 150 torchrun --nproc-per-node=2 bench/layer_step.py --tokens 1,64 --iters 5 --rounds 2 > $L/layer.log 2>&1; echo "layer exit $?"; tail -30 $L/layer.log
