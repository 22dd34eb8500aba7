#!/usr/bin/env bash
# One H200, tenth session: the encoding checks (dispatch dtype, combine mark) on simulated ranks,
# the whole simulated-rank suite, then an A/B of the MoE kernels against 32ecce2 (diag/ab/base32).
set -uo pipefail
OUT=$1; TAG=${TAG:-g}; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
mkdir -p $OUT/$TAG; SECONDS=0
git log -1 --format=%H > $OUT/$TAG/commit.txt; git diff --stat >> $OUT/$TAG/commit.txt; cat diag/ab/base32/commit.txt >> $OUT/$TAG/commit.txt
nvidia-smi -L > $OUT/$TAG/env.txt; python3 -c "import torch;print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> $OUT/$TAG/env.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$OUT/$TAG/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 120 env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim/test_sim_ep.py -k "disagree or stalled" -q -rs -p no:cacheprovider >$OUT/$TAG/gpu_sim_new.log 2>&1
echo "new tests rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim_new.log | tail -1)"; grep -E "^(FAILED|ERROR)|^E " $OUT/$TAG/gpu_sim_new.log | head -8
timeout ${SIM_T:-200} env SYMCOMM_REQUIRE_GPU=1 python3 -m pytest tests/gpu_sim -q -rs -p no:cacheprovider >$OUT/$TAG/gpu_sim.log 2>&1
echo "gpu_sim rc $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' $OUT/$TAG/gpu_sim.log | tail -1)"; grep -E "^(FAILED|ERROR)" $OUT/$TAG/gpu_sim.log | head -5
BASE=$(ls diag/ab/base32/libsymcomm*.so); NEW=$(ls symcomm/_native/libsymcomm*.so)
EARLY=0 timeout ${AB_T:-200} python3 diag/moe_ab.py base=$BASE new=$NEW ${TOKENS:-1 8 64 512 2048} 2>&1 | grep -v "warn\|^/opt" | tee $OUT/$TAG/ab_early0.txt | cut -c1-120; echo "ab early0 rc $? at ${SECONDS}s"
