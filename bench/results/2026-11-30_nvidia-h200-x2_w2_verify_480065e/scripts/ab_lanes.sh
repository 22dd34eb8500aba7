#!/usr/bin/env bash
# Session 21, call 1 (world 2): lanes.patch (warp 0's lanes advance the block's records) against
# the shipped loop in thread 0. One build of each, libraries swapped between runs, ABAB,
# flag-free forced, 1-64 KiB; then the simulated-rank flag-free tests on the B build.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/h; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/buildA.log 2>&1; echo "buildA rc $? at ${SECONDS}s"
SO=$(ls symcomm/_native/libsymcomm*.so); cp $SO /tmp/A.so
git apply diag/w14/lanes.patch; echo "patch rc $?"
python3 -m pip install --no-build-isolation --no-deps -e . >$D/buildB.log 2>&1; echo "buildB rc $? at ${SECONDS}s"
cp $SO /tmp/B.so
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q tests/gpu_sim/test_sim_flagfree_collectives.py \
  tests/gpu_sim/test_sim_flagfree_fp4.py tests/gpu_sim/test_sim_epochs.py tests/gpu_sim/test_sim_safety.py -p no:cacheprovider >$D/simB.log 2>&1
echo "simB rc $? $(tail -1 $D/simB.log) at ${SECONDS}s"
c=(-g 2 -n 20 -w 5 -G 10 -R 5 -b 1K -e 64K -f 4 --algo custom-flagfree)
for pass in 1 2; do
  for v in A B; do
    cp /tmp/$v.so $SO
    for op in all_reduce all_gather reduce_scatter; do
      timeout 60 symcomm-bench $op "${c[@]}" >$D/${op}_${v}_p$pass.log 2>&1; echo -n "$op/$v $? "
    done; echo "at ${SECONDS}s"
  done
done
for f in $D/*_p*.log; do echo "$(basename $f) $(grep -E '^ +[0-9]+ ' $f | awk '{print $6" "$NF}' | tr '\n' ' ')"; done
tar -czf $OUT/h.tgz -C $OUT h
