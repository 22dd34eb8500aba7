#!/usr/bin/env bash
# Call W4 (2026-11-28 session 4), nvidia-h200-x4, world 4, the session's last ~5 device minutes:
# what world 4 had not run (the MoE sweep, two layer steps, train_step), then the MoE table.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?}
mkdir -p "$OUT/w4"; F=$OUT/w4
WORLD=4 DEADLINE=190 PART=2 ONLY="bench_moe train_step layer_step_dp_moe layer_step_tp_block" \
  bash scripts/gpu_check.sh verify "$F/v" >"$F/verify_screen.txt" 2>&1
echo "verify w4: done at $((SECONDS-T0)) s"; tail -8 "$F/verify_screen.txt"
L=$((255 - (SECONDS-T0))); ((L > 50)) && L=50
((L > 20)) && { timeout "$L" symcomm-bench moe -g 4 --tokens 1,8,64,512,2048 -n 20 -w 5 -G 10 -R 3 --algo all --json "$F/moe.json" >"$F/moe.log" 2>&1
  echo "moe: exit $? at $((SECONDS-T0)) s"; grep -A12 "^# Summary" "$F/moe.log" | cut -c1-200; }
tar -czf "$OUT/w4.tgz" -C "$OUT" w4 build.log && rm -rf "$F"
