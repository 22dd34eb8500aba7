#!/usr/bin/env bash
# Session 22, call 1 (world 2): the barrier kernels' grid cap 64 (A, main) against 128 (B,
# grid128.patch: kMaxBlocks = kGridBlocks = 128). One build of each, libraries swapped between
# runs, ABAB; one-shot all_reduce (beside PyTorch's two-shot), push all_gather, one-shot
# reduce_scatter, 2-256 MiB. Then the FSDP diagnostic on A.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/g; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/buildA.log 2>&1; echo "buildA rc $? at ${SECONDS}s"
SO=$(ls symcomm/_native/libsymcomm*.so); cp $SO /tmp/A.so
git apply diag/w16/grid128.patch; echo "patch rc $?"
cp diag/w16/cacheB/*.o build/nvcc-cache/
python3 -m pip install --no-build-isolation --no-deps -e . >$D/buildB.log 2>&1; echo "buildB rc $? at ${SECONDS}s"
cp $SO /tmp/B.so
c=(-g 2 -n 20 -w 5 -G 10 -R 3 -b 2M -e 256M -f 2)
declare -A algo=([all_reduce]=custom-oneshot,symm_mem-twoshot [all_gather]=custom-push [reduce_scatter]=custom-oneshot)
for pass in 1 2; do
  for v in A B; do
    cp /tmp/$v.so $SO
    for op in all_reduce all_gather reduce_scatter; do
      timeout 90 symcomm-bench $op "${c[@]}" --algo ${algo[$op]} --json $D/${op}_${v}_p$pass.json >$D/${op}_${v}_p$pass.log 2>&1
      echo -n "$op/$v $? "
    done; echo "at ${SECONDS}s"
  done
done
cp /tmp/A.so $SO; git checkout csrc/peer.cuh
timeout 150 torchrun --nproc-per-node=2 diag/w15/fsdp_pooled.py --steps fsdp --json $D/fsdp_pooled.json >$D/fsdp_pooled.log 2>&1
echo "fsdp rc $? at ${SECONDS}s"; grep -E "^#|fsdp|pooled" $D/fsdp_pooled.log | tail -12
for f in $D/*_p*.log; do echo "== $(basename $f)"; grep -E '^ +[0-9]+ ' $f | cut -c1-160; done
tar -czf $OUT/g.tgz -C $OUT g
