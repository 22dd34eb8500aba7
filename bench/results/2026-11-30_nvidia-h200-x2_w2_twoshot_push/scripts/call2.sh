#!/usr/bin/env bash
# Session 23, call 2 (world 2): two-shot by stores with 4-pass unroll, grid cap 64 (A, this tree)
# against 128 for every barrier kernel (B, diag/w18/B.so = grid128.patch). ABAB.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SECONDS=0; D=$OUT/c2; mkdir -p $D
python3 -m pip install --no-build-isolation --no-deps -e . >$D/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
SO=$(ls symcomm/_native/libsymcomm*.so); cp $SO /tmp/A.so
SYMCOMM_REQUIRE_GPU=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim/test_sim_ranks.py -k "two_shot_by_stores" >$D/sim.log 2>&1
echo "sim rc $? at ${SECONDS}s"; tail -1 $D/sim.log
SYMCOMM_REQUIRE_GPU=1 timeout 100 torchrun --nproc-per-node=2 --no-python bash -c 'python3 -m pytest tests/gpu/test_custom_ar.py -q -rs -p no:cacheprovider -k "two_shot_into"' >$D/gpu.log 2>&1
echo "gpu rc $? at ${SECONDS}s"; grep -E "passed|failed" $D/gpu.log | tail -2
c=(-g 2 -n 20 -w 5 -G 10 -R 3 -b 4M -e 256M -f 4)
for pass in 1 2; do
  for v in A B; do
    if [[ $v == A ]]; then cp /tmp/A.so $SO; else cp diag/w18/B.so $SO; fi
    timeout 80 symcomm-bench all_reduce "${c[@]}" --algo custom-twoshot,custom-oneshot,symm_mem-twoshot --json $D/ar_${v}_p$pass.json >$D/ar_${v}_p$pass.log 2>&1
    echo -n "ar/$v $? "
    timeout 60 symcomm-bench all_gather "${c[@]}" --algo custom-push --json $D/ag_${v}_p$pass.json >$D/ag_${v}_p$pass.log 2>&1
    echo "ag/$v $? at ${SECONDS}s"
  done
done
cp /tmp/A.so $SO
for f in $D/a*_p*.log; do echo "== $(basename $f)"; grep -E '^ +[0-9]+ ' $f | cut -c1-200; done
tar -czf $OUT/c2.tgz -C $OUT c2
