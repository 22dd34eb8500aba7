#!/usr/bin/env bash
# The README's test command as written, on a one-GPU machine: the CPU tests, the simulated-rank
# GPU tests (tests/gpu_sim run here), tests/gpu skipping (it needs several GPUs).
# OUT=$OUT bash .../callF.sh   (carry symcomm/_native and build/nvcc-cache)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . > $OUT/install.txt 2>&1; echo "install rc=$?"
timeout 560 python3 -m pytest tests -q -rf -p no:cacheprovider --durations=15 > $OUT/readme_tests.txt 2>&1; echo "readme_tests rc=$? at ${SECONDS}s"
tail -25 $OUT/readme_tests.txt
