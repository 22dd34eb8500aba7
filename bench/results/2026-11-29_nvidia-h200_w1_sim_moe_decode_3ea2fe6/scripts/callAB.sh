#!/usr/bin/env bash
# One H200: A/B of the MoE kernels (diag/moe_ab.py), HEAD's build against the working tree's.
set -uo pipefail
OUT=$1; TAG=${TAG:-ab}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt; cat diag/ab/base_commit.txt >> $OUT/$TAG/commit.txt
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
ls diag/ab/base/symcomm/_native/libsymcomm*.so >/dev/null 2>&1 || (mkdir -p diag/ab/base/symcomm/_native; cd diag/ab/base && python3 setup.py build_ext --inplace) >$OUT/$TAG/base_build.log 2>&1; echo "base build rc $? at ${SECONDS}s"
BASE=$(ls diag/ab/base/symcomm/_native/libsymcomm*.so); NEW=$(ls symcomm/_native/libsymcomm*.so)
G4=$(ls diag/ab/nopf/symcomm/_native/libsymcomm*.so 2>/dev/null); timeout ${AB_T:-240} python3 diag/moe_ab.py base=$BASE new=$NEW ${G4:+nopf=$G4} ${TOKENS:-1 8 64} 2>&1 | grep -v "warn\|^/opt" | tee $OUT/$TAG/ab.txt | cut -c1-150; echo "ab rc $? at ${SECONDS}s"
if [ -n "${SIM:-}" ]; then timeout ${SIM_T:-200} env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest $SIM -q -rs -x -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"; fi
