#!/usr/bin/env bash
# Issue 26 before/after on one GPU. Run from the repository root on the device.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NEW=$PWD; OLD=$PWD/build/before
mkdir -p $OUT/b
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } > $OUT/b/env.txt 2>&1
# correctness first
PYTHONPATH=$NEW:$NEW/tests SYMCOMM_REQUIRE_GPU=1 timeout 200 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider > $OUT/b/gpu_sim.txt 2>&1; echo "gpu_sim rc=$?"; tail -3 $OUT/b/gpu_sim.txt
grep -h "unwaiting dependent" $OUT/b/gpu_sim.txt
PYTHONPATH=$NEW timeout 150 torchrun --nproc-per-node=1 scripts/world1_check.py > $OUT/b/world1_check.txt 2>&1; echo "world1 rc=$?"; grep -E "FAIL|memory loop|checks passed|memory:" $OUT/b/world1_check.txt | cut -c1-600
# memory, one fresh process per case
PYTHONPATH=$NEW timeout 120 python3 bench/comm_memory.py --cases symcomm,symcomm_graph_comms,pg_then_symcomm,pg_then_symcomm_graph_comms --json $OUT/b/mem_after.json > $OUT/b/mem_after.txt 2>&1; echo "mem after rc=$?"
PYTHONPATH=$OLD timeout 90 python3 bench/comm_memory.py --cases symcomm,pg_then_symcomm --json $OUT/b/mem_before.json > $OUT/b/mem_before.txt 2>&1; echo "mem before rc=$?"
cat $OUT/b/mem_after.txt $OUT/b/mem_before.txt | cut -c1-400
# graph timings at world 1, before and after interleaved
for op in all_reduce all_gather reduce_scatter; do
  for run in old1 new1 old2 new2; do
    P=$NEW; [ ${run#old} != $run ] && P=$OLD
    PYTHONPATH=$P timeout 60 python3 -m symcomm.bench $op -b 1K -e 256M -f 4 -G 10 -n 20 -R 3 --algo all --json $OUT/b/t_${op}_${run}.json > $OUT/b/t_${op}_${run}.log 2>&1; echo "$op $run rc=$?"
  done
done
tar -czf $OUT/b.tgz -C $OUT b && rm -rf $OUT/b
