#!/usr/bin/env bash
# Final call H2 (2026-11-28 session 5), nvidia-h200-x2, world 2 on the final commit: the layer
# steps and train_step (scripts/gpu_check.sh verify, part 2, the steps H1 left).
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?}
mkdir -p "$OUT/h2"; F=$OUT/h2
DEADLINE=${H2_DEADLINE:-280} PART=2 ONLY="layer_step_dp_moe layer_step_tp_block layer_step_ep_moe train_step" \
  bash scripts/gpu_check.sh verify "$F/v" >"$F/verify_screen.txt" 2>&1
echo "verify part 2 (steps): done at $((SECONDS-T0)) s"; tail -10 "$F/verify_screen.txt"
tar -czf "$OUT/h2.tgz" -C "$OUT" h2 build.log && rm -rf "$F"
