#!/usr/bin/env bash
# Call E3 (2026-11-28 session 3) on the final commit. First, world 2 beside each other:
# GPUs 0,1 the sweeps E2 lost or that the shipped table and the new launcher change
# (all_gatherv, all_reduce, reduce_scatterv); GPUs 2,3 MoE on this commit and on 159a1db.
# Then world 4 on all four GPUs: tests/gpu, tune, every sweep with that table, the examples.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?}
mkdir -p "$OUT/w2a" "$OUT/w2b" "$OUT/w4" /tmp/v
xz -dc diag/v/base.so.xz > /tmp/v/base.so
( CUDA_VISIBLE_DEVICES=0,1 DEADLINE=100 PART=2 ONLY="bench_all_gatherv bench_all_reduce bench_reduce_scatterv" \
  bash scripts/gpu_check.sh verify "$OUT/w2a" >"$OUT/w2a/screen.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=2,3; B=$OUT/w2b
  M=(--tokens 1,8,64,512,2048 -n 20 -w 5 -G 10 -R 3 --algo all)
  timeout 45 symcomm-bench moe -g 2 "${M[@]}" --json "$B/moe_new.json" >"$B/moe_new.log" 2>&1; echo "moe_new: exit $?" >>"$B/steps.txt"
  timeout 45 env PYTHONPATH="$PWD/diag/base_tree" SYMCOMM_NATIVE_LIBRARY=/tmp/v/base.so python3 -m symcomm.bench moe -g 2 "${M[@]}" \
    --json "$B/moe_base.json" >"$B/moe_base.log" 2>&1; echo "moe_base: exit $?" >>"$B/steps.txt" ) &
wait
T0=$SECONDS
WORLD=4 TEST_TIMEOUT=200 DEADLINE=230 PART=1 ONLY="tests_gpu" bash scripts/gpu_check.sh verify "$OUT/w4/t" >"$OUT/w4/tests_screen.txt" 2>&1
timeout 120 symcomm-bench tune -g 4 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o "$OUT/w4/nvidia_h200_w4.json" >"$OUT/w4/tune.log" 2>&1
echo "tune_w4: exit $? at $((SECONDS - T0)) s" >>"$OUT/w4/steps.txt"
T=(); [[ -f $OUT/w4/nvidia_h200_w4.json ]] && T=(SYMCOMM_TUNING_FILE="$OUT/w4/nvidia_h200_w4.json")
env "${T[@]}" WORLD=4 DEADLINE=$((440 - SECONDS)) PART=2 ONLY="bench_*" bash scripts/gpu_check.sh verify "$OUT/w4/v" >"$OUT/w4/verify_screen.txt" 2>&1
env "${T[@]}" WORLD=4 DEADLINE=$((545 - SECONDS)) PART=1 ONLY="example_*" bash scripts/gpu_check.sh verify "$OUT/w4/x" >"$OUT/w4/examples_screen.txt" 2>&1
cat "$OUT/w2b/steps.txt" "$OUT/w4/steps.txt"; tail -6 "$OUT/w2a/screen.txt"; tail -5 "$OUT/w4/tests_screen.txt"; tail -14 "$OUT/w4/verify_screen.txt"; tail -9 "$OUT/w4/examples_screen.txt"
for f in moe_new moe_base; do echo "== $f"; grep -A12 "^# Summary" "$OUT/w2b/$f.log" | grep "│" | cut -c1-230; done
tar -czf "$OUT/e3.tgz" -C "$OUT" w2a w2b w4 build.log && rm -rf "$OUT/w2a" "$OUT/w2b" "$OUT/w4"
