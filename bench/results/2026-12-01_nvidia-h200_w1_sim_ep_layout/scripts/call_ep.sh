#!/usr/bin/env bash
# Session 30 (one H200): the MoE dispatch's layout on two simulated ranks: the EP simulated-rank
# tests on the working tree, then the dispatch alone in builds side by side (epvar.py).
#   bash diag/w30/call_ep.sh $OUT        (VARIANTS, TOKENS, MAXB, SIM)
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
SECONDS=0; rm -rf /tmp/v_*
VARIANTS=${VARIANTS:-old old+norows norows}
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
python3 diag/w30/epvar.py /tmp/v_ $VARIANTS >$OUT/variants_build.txt 2>&1 &
timeout ${SIM_T:-200} env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest ${SIM:-tests/gpu_sim/test_sim_ep.py tests/gpu_sim/test_sim_fp4_dispatch.py} -q -rs -p no:cacheprovider >$OUT/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)" $OUT/gpu_sim.log | head -8
wait; cat $OUT/variants_build.txt; echo "variants at ${SECONDS}s"
LIBS=""
for v in $VARIANTS; do so=$(ls /tmp/v_$v/symcomm/_native/libsymcomm*.so 2>/dev/null) && LIBS="$LIBS $v=$so" || tail -5 /tmp/v_$v/variant_build.log; done
LIBS="$LIBS new=$(ls $PWD/symcomm/_native/libsymcomm*.so)"
timeout ${AB_T:-300} python3 diag/w30/ep_ab.py $LIBS ${TOKENS:-1 64 512 2048} 2>&1 | grep -v "warn\|^/opt" >$OUT/ep_ab.txt
echo "ab rc $? at ${SECONDS}s"; cut -c1-200 $OUT/ep_ab.txt
