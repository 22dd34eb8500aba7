#!/usr/bin/env bash
# Session 25: the copy-ordering GPU test against the backends before the fix (must fail), then
# after (must pass), both at world 2. Then part 1 of the verification follows in the same call.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/pre; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/pre/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
run() {
  timeout 150 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
    'python3 -m pytest tests/gpu/test_custom_ar.py -q -rs -p no:cacheprovider -k "copied_input or empty_tensor" > '$OUT'/pre/$1.rank$LOCAL_RANK.log 2>&1' _ $1
  echo "$1 rc $? at ${SECONDS}s"; tail -n 3 $OUT/pre/$1.rank*.log
}
cp diag/w25/old/*.py symcomm/backends/; run before_fix
cp diag/w25/new/*.py symcomm/backends/; run after_fix
