#!/usr/bin/env bash
# Session 25, last call: the copy-ordering test before/after the backend fix (three cases now),
# then tests/gpu at world 2 under torchrun and the simulated-rank suite, on the final tests.
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/f; SECONDS=0
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/f/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
run() {  # $1 name, $2 pytest args
  timeout 200 env SYMCOMM_REQUIRE_GPU=1 torchrun --nproc-per-node=2 --no-python bash -c \
    'python3 -m pytest '"$2"' -q -rs -p no:cacheprovider > '$OUT'/f/$1.rank$LOCAL_RANK.log 2>&1' _ $1 >$OUT/f/$1.torchrun.log 2>&1
  echo "$1 rc $? at ${SECONDS}s"; tail -n 1 $OUT/f/$1.rank*.log
}
cp diag/w25/old/*.py symcomm/backends/; run before_fix "tests/gpu/test_custom_ar.py -k copied_input"
cp diag/w25/new/*.py symcomm/backends/; run after_fix "tests/gpu/test_custom_ar.py -k copied_input"
for f in diag/w25/new/*.py; do cmp -s $f symcomm/backends/$(basename $f) || echo "NOT RESTORED $f"; done
run tests_gpu "tests/gpu"
CUDA_VISIBLE_DEVICES=0 SYMCOMM_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q tests/gpu_sim/test_sim_ranks.py \
  -p no:cacheprovider >$OUT/f/sim_ranks.log 2>&1
echo "sim rc $? $(tail -1 $OUT/f/sim_ranks.log) at ${SECONDS}s"
