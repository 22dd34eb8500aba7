#!/usr/bin/env bash
# Session 26, call 1 (world 2): build; the norm-race probe (which shapes let an unwaiting dependent
# read stale behind the norm with early signals on); the uneven ops at 64K-16M with more samples;
# the whole simulated-rank suite.
#   COMMIT=sha bash diag/w26/dev1.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
D=$OUT/d; mkdir -p $D; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 diag/w26/norm_race_probe.py >$D/probe.log 2>&1; echo "probe rc $? at ${SECONDS}s"; cat $D/probe.log | tail -9
for op in reduce_scatterv all_gatherv; do
  timeout 60 symcomm-bench $op -g 2 -b 64K -e 16M -f 4 -n 20 -w 5 -G 20 -R 3 --algo nccl,custom-flagfree,auto >$D/uneven_$op.log 2>&1
  echo "$op rc $? at ${SECONDS}s"; grep -A12 "Summary" $D/uneven_$op.log | head -14
done
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 260 python3 -m pytest -q tests/gpu_sim -p no:cacheprovider >$D/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)" $D/gpu_sim.log | head; tail -n 1 $D/gpu_sim.log
tar -czf $OUT/d.tgz -C $OUT d && rm -rf $D
