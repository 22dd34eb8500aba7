#!/usr/bin/env bash
# Session 19, call 5 (world 2): does advancing every record per launch (thread 0 of a narrow
# launch stores 4 pairs) cost small calls anything against session 18's two pairs? One build of
# each (B: the loop patched to records b and b + grid only, safe here because these processes
# only launch the narrow grid), their libraries swapped between runs, ABAB, flag-free forced.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/h; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/buildA.log 2>&1; echo "buildA rc $? at ${SECONDS}s"
SO=$(ls symcomm/_native/libsymcomm*.so); cp $SO /tmp/A.so
sed -i 's|    for (unsigned r = blockIdx.x; r < kFlagFreeRecords; r += gridDim.x) {|    for (unsigned r = blockIdx.x; r < kFlagFreeRecords \&\& r < blockIdx.x + 2 * gridDim.x; r += gridDim.x) {|' csrc/peer.cuh
grep -c "2 \* gridDim.x" csrc/peer.cuh
python3 -m pip install --no-build-isolation --no-deps -e . >$D/buildB.log 2>&1; echo "buildB rc $? at ${SECONDS}s"
cp $SO /tmp/B.so
c=(-g 2 -n 20 -w 5 -G 10 -R 5 -b 1K -e 64K -f 4 --algo custom-flagfree)
for pass in 1 2; do
  for v in A B; do
    cp /tmp/$v.so $SO
    for op in all_reduce all_gather reduce_scatter; do
      timeout 60 symcomm-bench $op "${c[@]}" >$D/${op}_${v}_p$pass.log 2>&1; echo -n "$op/$v $? "
    done; echo "at ${SECONDS}s"
  done
done
for f in $D/*_p*.log; do echo "$(basename $f) $(grep -E '^ +[0-9]+ ' $f | awk '{print $6}' | tr '\n' ' ')"; done
tar -czf $OUT/h.tgz -C $OUT h
