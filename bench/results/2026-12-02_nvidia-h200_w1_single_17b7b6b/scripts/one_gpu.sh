#!/usr/bin/env bash
# Session 31, one H200: a one-GPU user's commands, the examples (torch.compile with the ordered
# effect registration on this image's torch), the CPU tests this session touched on this image's
# torch, and the simulated-rank suite.   COMMIT=<sha> bash scripts/one_gpu.sh $OUT
set -uo pipefail
OUT=$1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=$OUT/s; mkdir -p $S; SECONDS=0
echo "$COMMIT" > $S/commit.txt; nvidia-smi -L > $S/gpus.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $S/gpus.txt 2>&1
python3 -m pip install --no-build-isolation --no-deps -e . >$S/build.log 2>&1; echo "build rc $? at ${SECONDS}s"
timeout 60 symcomm-bench all_reduce -g 2 -b 1K -e 1M >$S/readme_bench.txt 2>&1
echo "readme bench rc $? at ${SECONDS}s: $(grep -c '^ *[0-9]' $S/readme_bench.txt) rows"
timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$S/world1.txt 2>&1; echo "world1 rc $? at ${SECONDS}s: $(tail -1 $S/world1.txt)"
SYMCOMM_CHECK=1 timeout 90 torchrun --nproc-per-node=1 scripts/world1_check.py >$S/world1_check_mode.txt 2>&1; echo "world1 check rc $? at ${SECONDS}s: $(tail -1 $S/world1_check_mode.txt)"
timeout 40 torchrun --nproc-per-node=1 examples/quickstart.py >$S/quickstart_w1.txt 2>&1; echo "quickstart rc $? at ${SECONDS}s"
python3 - >$S/effects.txt 2>&1 <<'PY'
import torch, symcomm  # noqa: F401  (importing registers the ops)
from torch._higher_order_ops import effects
print("torch", torch.__version__, "torch.library._register_effectful_op:", hasattr(torch.library, "_register_effectful_op"))
for n in sorted(dir(torch.ops.symcomm)):
    packet = getattr(torch.ops.symcomm, n)
    if hasattr(packet, "default"):
        print(f"{packet.default}: {effects._get_effect(packet.default) if hasattr(effects, '_get_effect') else effects.SIDE_EFFECTS.get(packet.default)}")
PY
echo "effects at ${SECONDS}s:"; cat $S/effects.txt | head -20
timeout 200 torchrun --nproc-per-node=1 scripts/examples_world1.py >$S/examples_w1.txt 2>&1; echo "examples rc $? at ${SECONDS}s: $(tail -1 $S/examples_w1.txt)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gloo_api.py >$S/gloo_api.txt 2>&1; echo "test_gloo_api rc $? at ${SECONDS}s: $(tail -1 $S/gloo_api.txt)"
timeout 160 python3 -m pytest -q -p no:cacheprovider tests/gpu_sim >$S/gpu_sim.txt 2>&1; echo "gpu_sim rc $? at ${SECONDS}s: $(tail -1 $S/gpu_sim.txt)"
tar -czf $OUT/s.tgz -C $OUT s && rm -rf $S
