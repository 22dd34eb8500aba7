#!/usr/bin/env bash
# Call E2 (2026-11-28 session 3): world-2 verification of the candidate final commit on two GPU
# pairs of a 4-GPU host. GPUs 0,1: tests/gpu, examples, layer steps, train_step. GPUs 2,3: tune,
# the nccl-tests/PyTorch comparison with that table, every other sweep, then 159a1db (its tree in
# diag/base_tree with its library) against this commit for MoE and the norm, and nccl-tests'
# alltoall at MoE's byte counts.
set -u
OUT=$1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export SKIP_BUILD=1 COMMIT=${COMMIT:?} TEST_TIMEOUT=240
mkdir -p "$OUT/a" "$OUT/b" /tmp/v; chmod +x .nccl-tests/bin/* 2>/dev/null
xz -dc diag/v/base.so.xz > /tmp/v/base.so
( export CUDA_VISIBLE_DEVICES=0,1 DEADLINE=540 PART=all ONLY="tests_gpu example_* layer_step_* train_step"
  bash scripts/gpu_check.sh verify "$OUT/a" >"$OUT/a/screen.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=2,3 MASTER_PORT=29611 PET_MASTER_PORT=29611; B=$OUT/b
  s() { local n=$1 t=$2; shift 2; local t0=$SECONDS; ((t > 530 - SECONDS)) && t=$((530 - SECONDS)); ((t < 15)) && { echo "$n: SKIPPED" >>"$B/steps.txt"; return; }; timeout "$t" "$@" >"$B/$n.log" 2>&1; echo "$n: exit $? in $((SECONDS-t0)) s" >>"$B/steps.txt"; }
  s tune_w2 120 symcomm-bench tune -g 2 -d bfloat16 -b 1K -e 64M -n 20 -w 5 -G 10 -R 3 -o "$B/nvidia_h200_w2.json"
  T=(); [[ -f $B/nvidia_h200_w2.json ]] && T=(SYMCOMM_TUNING_FILE="$B/nvidia_h200_w2.json")
  env "${T[@]}" WORLD=2 ROUNDS=3 DEADLINE=200 bash scripts/gpu_check.sh compare "$B/cmp" >"$B/compare_screen.txt" 2>&1
  echo "compare: done at $SECONDS s" >>"$B/steps.txt"
  env "${T[@]}" DEADLINE=$((500 - SECONDS)) PART=2 ONLY="bench_*" bash scripts/gpu_check.sh verify "$B/v" >"$B/verify_screen.txt" 2>&1
  echo "verify part 2: done at $SECONDS s" >>"$B/steps.txt"
  LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
  s alltoall 40 env LD_LIBRARY_PATH="$LIB" .nccl-tests/bin/alltoall_perf -g 2 -b 58720256 -e 234881024 -f 4 -n 20 -w 5 -G 20 -d bfloat16
  s moe_new 60 symcomm-bench moe -g 2 --tokens 1,8,64,512,2048 -n 20 -w 5 -G 10 -R 3 --algo peer-push,peer-push:dispatch,peer-push+nvfp4,peer-push+nvfp4:dispatch --json "$B/moe_new.json"
  s moe_base 60 env PYTHONPATH="$PWD/diag/base_tree" SYMCOMM_NATIVE_LIBRARY=/tmp/v/base.so python3 -m symcomm.bench moe -g 2 --tokens 1,8,64,512,2048 -n 20 -w 5 -G 10 -R 3 --algo peer-push,peer-push:dispatch,peer-push+nvfp4,peer-push+nvfp4:dispatch --json "$B/moe_base.json"
) &
wait
cat "$OUT/b/steps.txt"; tail -12 "$OUT/b/verify_screen.txt"; tail -14 "$OUT/a/screen.txt"; tail -40 "$OUT/b/compare_screen.txt"
for f in moe_new moe_base alltoall; do echo "== $f"; grep -A12 "^# Summary" "$OUT/b/$f.log" | grep "│" | cut -c1-200; done; grep -E "^ +[0-9]+ " "$OUT/b/alltoall.log" | head
tar -czf "$OUT/e2.tgz" -C "$OUT" a b build.log && rm -rf "$OUT/a" "$OUT/b"
